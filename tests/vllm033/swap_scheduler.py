"""A pytest plugin that runs vLLM 0.33's own scheduler tests with `hybridkv.vllm.Scheduler`
in the place of vLLM's scheduler (``scripts/run_vllm_scheduler_tests.sh`` drives it).

No vLLM test code lives here: vLLM's test files are downloaded from its source release
and run unchanged. The plugin only

* replaces the names ``Scheduler`` and ``AsyncScheduler`` with hybridkv's two forms
  (vLLM's tests name the form; an engine names ``Scheduler``, which builds the async
  form itself when ``async_scheduling`` is on) in vLLM's test helper module
  ``tests.v1.core.utils``, whose ``create_scheduler`` builds the scheduler of almost
  every test, and in the test modules (a few tests build ``Scheduler(...)`` directly),
  when ``HYBRIDKV_SWAP=1``;
* records, per test, its outcome, whether a hybridkv scheduler was built, and the last
  line of the failure, as JSON lines in ``HYBRIDKV_SWAP_LOG`` (the summary reads them).

``python swap_scheduler.py hub DIR`` writes the Hugging Face hub cache the tests' model
names resolve to offline (config.json only, from transformers' config classes, whose
defaults are those checkpoints' geometry): the tests read configs, never weights.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

SWAP = os.environ.get("HYBRIDKV_SWAP", "0") == "1"
LOG_PATH = os.environ.get("HYBRIDKV_SWAP_LOG", "")
# vLLM's test modules whose ``Scheduler`` name is replaced
PATCHED_MODULES = (
    "tests.v1.core.utils",
    "tests.v1.core.test_scheduler",
    "tests.v1.core.test_async_scheduler",
    "tests.v1.core.test_swa_inflight_window_free",
    "tests.v1.core.test_reset_prefix_cache_e2e",
    "tests.v1.core.test_deferred_block_free",
)

SCHEDULER_TESTS = "tests/v1/core/test_scheduler.py::"

_built: list[str] = []  # qualified class names of the schedulers built in the current test
_pending: list[Any] = []  # hybridkv schedulers built in the current test


def _counting(cls: type) -> type:
    """``cls`` with a constructor that records each scheduler it builds."""
    init = cls.__init__

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        name = f"{type(self).__module__}.{type(self).__qualname__}"
        _built.append(name)
        init(self, *args, **kwargs)
        if name.startswith("hybridkv."):
            # hybridkv's __init__ goes on after this one: its flag is read after the test
            _pending.append(self)

    cls.__init__ = __init__  # type: ignore[method-assign]
    return cls


@pytest.fixture(autouse=True)
def _hybridkv_scheduler(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    _built.clear()
    _pending.clear()
    if SWAP:
        from hybridkv.vllm.scheduler import AsyncScheduler, Scheduler

        # vLLM's tests pick the async form by name (on vLLM-CPU the config says sync)
        swaps = {"Scheduler": Scheduler, "AsyncScheduler": AsyncScheduler}
        for name in PATCHED_MODULES:
            module = sys.modules.get(name)
            if module is None:
                continue
            for attr, cls in swaps.items():
                if hasattr(module, attr):
                    monkeypatch.setattr(module, attr, cls)
    yield


def pytest_configure(config: pytest.Config) -> None:
    from vllm.v1.core.sched.scheduler import Scheduler as VllmScheduler

    _counting(VllmScheduler)  # hybridkv's subclass calls it too


def _failure_line(report: pytest.TestReport) -> str:
    crash = getattr(report.longrepr, "reprcrash", None)
    if crash is not None:
        return str(crash.message).splitlines()[0][:300] if crash.message else ""
    return str(report.longrepr).splitlines()[-1][:300] if report.longrepr else ""


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if not LOG_PATH:
        return
    if report.when == "call" or (report.when == "setup" and report.outcome != "passed"):
        outcome = report.outcome
        if report.when == "setup" and outcome == "failed":
            outcome = "error"
        record = {
            # test_scheduler.py's tests by name alone, other files' with the file
            "test": report.nodeid.removeprefix(SCHEDULER_TESTS),
            "outcome": outcome,
            "hybridkv": any(name.startswith("hybridkv.") for name in _built),
            # hybridkv's manager in charge (False: a setup it leaves to vLLM's manager)
            "active": any(getattr(s, "hybridkv_active", True) for s in _pending),
            "schedulers": len(_built),
            "error": _failure_line(report) if outcome in ("failed", "error") else "",
        }
        with open(LOG_PATH, "a") as log:
            log.write(json.dumps(record) + "\n")


# ---------------------------------------------------------------------- offline hub
HUB_MODELS = {
    # model name in vLLM's tests -> transformers config class with that geometry
    "facebook/opt-125m": ("OPTConfig", "OPTForCausalLM"),
    "Qwen/Qwen3-Next-80B-A3B-Instruct": ("Qwen3NextConfig", "Qwen3NextForCausalLM"),
    "llava-hf/llava-1.5-7b-hf": ("LlavaConfig", "LlavaForConditionalGeneration"),
}
REVISION = "0" * 40


def write_hub(cache_dir: Path) -> None:
    """config.json of each model in ``HUB_MODELS`` in a hub cache at ``cache_dir``."""
    import transformers

    for name, (config_cls, arch) in HUB_MODELS.items():
        repo = cache_dir / ("models--" + name.replace("/", "--"))
        snapshot = repo / "snapshots" / REVISION
        snapshot.mkdir(parents=True, exist_ok=True)
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / "main").write_text(REVISION)
        config = getattr(transformers, config_cls)(architectures=[arch])
        config.save_pretrained(snapshot)


# ---------------------------------------------------------------------- summary
def _load(path: Path) -> dict[str, dict[str, Any]]:
    if not path.exists():
        return {}
    return {r["test"]: r for r in map(json.loads, path.read_text().splitlines())}


def summarize(stock_log: Path, swapped_log: Path) -> str:
    """The swapped run against the stock run, test by test: counts, then every test
    that passes on vLLM's scheduler and not on hybridkv's, grouped by its failure."""
    stock, swapped = _load(stock_log), _load(swapped_log)
    counts: dict[str, int] = {}
    regressions: dict[str, list[str]] = {}
    for test, rec in swapped.items():
        base = stock.get(test, {}).get("outcome", "not run")
        ours = rec["outcome"]
        if base != "passed" and stock:
            key = f"stock {base} (environment or vLLM), hybridkv {ours}"
        else:
            if not rec["hybridkv"]:
                where = "no hybridkv scheduler built"
            elif rec.get("active", True):
                where = "hybridkv's manager"
            else:
                where = "hybridkv's scheduler left it to vLLM's manager"
            key = f"{ours}: {where}"
            if ours != "passed":
                regressions.setdefault(rec["error"] or ours, []).append(test)
        counts[key] = counts.get(key, 0) + 1
    lines = [f"{len(swapped)} tests with hybridkv.vllm.Scheduler swapped in", ""]
    lines += [f"  {n:4d}  {key}" for key, n in sorted(counts.items(), key=lambda kv: -kv[1])]
    lines += ["", "Failures on hybridkv's scheduler that pass on vLLM's, by error:"]
    for error, tests in sorted(regressions.items(), key=lambda kv: -len(kv[1])):
        lines.append(f"- [{len(tests)}] {error}")
        lines += [f"      {t}" for t in sorted(tests)]
    return "\n".join(lines)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "hub":
        write_hub(Path(sys.argv[2]))
    elif len(sys.argv) == 4 and sys.argv[1] == "summary":
        print(summarize(Path(sys.argv[2]), Path(sys.argv[3])))
    else:
        raise SystemExit(
            "usage: python swap_scheduler.py hub DIR | summary STOCK.jsonl SWAPPED.jsonl"
        )
