"""Multi-turn prefix hits with drafts on vLLM 0.33's scheduler over hybridkv's manager,
synchronous vs async scheduling (`tests/vllm033/test_async_scheduling.py`'s chat: six
sessions, three turns, 3 drafts a step, 16-token blocks, a fake worker). Prints each
turn's hit tokens against the bound (every token of the session before the turn's new
ones). Runs in vLLM 0.33's venv from the repository root::

    VLLM_TARGET_DEVICE=cpu .venv-vllm033/bin/python scripts/async_draft_hits.py
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.vllm033.test_async_scheduling import chat
from tests.vllm033.test_hybridkv_scheduler import model_dir


def main() -> None:
    folder = Path(tempfile.mkdtemp())
    write_config = getattr(model_dir, "__wrapped__", model_dir)  # the fixture's body
    config_dir = write_config(type("Factory", (), {"mktemp": lambda self, _: folder})())
    print("layout  scheduling  turn 2 hits / bound   turn 3 hits / bound")
    for layout in ("full", "hybrid"):
        for async_on in (False, True):
            hits, bounds = chat(config_dir, layout, async_on)
            cells = [
                f"{sum(hits[t]):>5} / {sum(bounds[t]):<5} ({sum(hits[t]) / sum(bounds[t]):.1%})"
                for t in (1, 2)
            ]
            print(f"{layout:7} {'async' if async_on else 'sync':11} {cells[0]:>22} {cells[1]:>22}")


if __name__ == "__main__":
    main()
