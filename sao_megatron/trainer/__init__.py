"""The RL loop (`sao train`): loop.py reads top to bottom; services.py builds what it talks to."""
