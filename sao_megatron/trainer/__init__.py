"""The RL loop (`sao train`): loop.py reads top to bottom; components.py builds what it talks to once."""
