"""A vLLM ``custom_class`` drafter whose draft counts follow a script, for tests.

``speculative_config={"method": "custom_class", "model":
"tests.vllm_plugin.scripted_proposer.ScriptedProposer", "num_speculative_tokens": K}`` with
``HYBRIDKV_TEST_DRAFT_SCRIPT="16,1,0,5"``: step ``i`` proposes ``script[i % len]`` drafts
(at most K) for every request. With ``HYBRIDKV_TEST_DRAFT_ORACLE`` naming a JSON list
of token sequences (a reference run's prompts + outputs), a request whose tokens so far
begin one of them gets that sequence's next tokens as drafts (the reference's greedy
tokens: mostly accepted, until the numerics of verify steps make a session diverge);
otherwise drafts guess like an n-gram drafter (the tokens that followed the last earlier
occurrence of the last token, else that token repeated). It runs in the engine's own
process (``in_process``), where the repository root is on ``sys.path``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

SCRIPT_ENV = "HYBRIDKV_TEST_DRAFT_SCRIPT"
ORACLE_ENV = "HYBRIDKV_TEST_DRAFT_ORACLE"


class ScriptedProposer:
    def __init__(self, vllm_config: Any) -> None:
        self.k = int(vllm_config.speculative_config.num_speculative_tokens)
        script = os.environ.get(SCRIPT_ENV, "1")
        self.script = [min(int(x), self.k) for x in script.split(",")]
        self.step = 0
        oracle = os.environ.get(ORACLE_ENV)
        self.oracle: list[list[int]] = json.loads(Path(oracle).read_text()) if oracle else []

    def load_model(self, model: Any) -> None:
        """vLLM-CPU's runner hands every drafter the target model; this one needs none."""

    def propose(
        self,
        sampled_token_ids: list[list[int]],
        num_tokens_no_spec: Any,
        token_ids_cpu: Any,
        slot_mappings: Any = None,
    ) -> list[list[int]]:
        count = self.script[self.step % len(self.script)]
        self.step += 1
        out = []
        for i, sampled in enumerate(sampled_token_ids):
            if not sampled or count == 0:
                out.append([])
                continue
            history = [int(t) for t in token_ids_cpu[i, : int(num_tokens_no_spec[i])]]
            out.append(self._oracle(history, count) or _guess(history, count))
        return out

    def _oracle(self, history: list[int], count: int) -> list[int]:
        n = len(history)
        for seq in self.oracle:
            if len(seq) > n and seq[:n] == history:
                return seq[n : n + count]
        return []


def _guess(history: list[int], count: int) -> list[int]:
    last = history[-1]
    for start in range(len(history) - 2, -1, -1):
        if history[start] == last:
            follow = history[start + 1 : start + 1 + count]
            return follow + [last] * (count - len(follow))
    return [last] * count
