"""The agent tests' scripted engine (tests/unit/test_agent.py, tests/integration/
test_agent_processes.py): it answers each call with ids the test chose."""

from __future__ import annotations

import threading
from concurrent.futures import Future

from slipstream.engine.base import Completion, GenerateRequest
from slipstream.model.tokenizer import CharTokenizer

TOK = CharTokenizer()


class ScriptedEngine:
    """An Engine that answers call k with `replies[k]` (ids), logprob -0.1*k per token and
    version 7; records every request."""

    def __init__(self, replies: list[list[int]]) -> None:
        self.replies = replies
        self.requests: list[GenerateRequest] = []
        self.aborted: list[str] = []
        self.lock = threading.Lock()

    @property
    def version(self) -> int:
        return 7

    def submit(self, request: GenerateRequest) -> Future[list[Completion]]:
        with self.lock:
            k = len(self.requests)
            self.requests.append(request)
        ids = self.replies[k % len(self.replies)][: request.params.max_new_tokens]
        c = Completion(request.request_id, 0, list(request.prompt_ids), list(ids), TOK.decode(ids),
                       [-0.1 * (k + 1)] * len(ids), "stop", [7] * len(ids))  # fmt: skip
        fut: Future[list[Completion]] = Future()
        fut.set_result([c])
        return fut

    def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)
