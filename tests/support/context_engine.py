"""A scripted engine that refuses over-long requests as SGLang does (used by the driver, agent and eval tests)."""
from __future__ import annotations

from rollout.engines.scripted import ScriptedEngine


class ContextEngine(ScriptedEngine):
    """A fake engine that refuses, as SGLang 0.5.23 does (HTTP 400), a request whose prompt +
    max_new_tokens passes `context`; `requests` records (input length, max_new_tokens) of each call."""

    def __init__(self, name, *, context, **kw):
        super().__init__(name, **kw)
        self.context, self.requests = context, []

    async def generate(self, request):
        from rollout.engines.engine import EngineError

        self.requests.append((len(request.input_ids), request.max_new_tokens))
        if len(request.input_ids) + request.max_new_tokens > self.context:
            raise EngineError(f"engine {self.name} answered HTTP 400: Requested token count exceeds the model's "
                              f"maximum context length of {self.context} tokens")
        return await super().generate(request)
