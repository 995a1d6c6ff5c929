"""An engine step that raises part-way fails that step's requests and the server goes on
serving: the scheduler abandons the step (`Scheduler.abandon`) instead of waiting for an
update that never comes, and every block goes back."""

from __future__ import annotations

import pytest


def test_server_serves_after_a_failed_step() -> None:
    torch = pytest.importorskip("torch")
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("fastapi")
    from hybridkv.cli.engine import load_llm
    from hybridkv.serve.server import BackgroundServer

    torch.set_num_threads(1)
    llm = load_llm("demo")
    expected = load_llm("demo").generate(["the cat"], 5, ignore_eos=True)[0].token_ids
    execute = llm.stepper.execute
    calls = {"n": 0}

    def flaky(output):  # the second step raises, as a kernel error would
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("injected kernel failure")
        return execute(output)

    llm.stepper.execute = flaky
    body = {"model": "demo", "prompt": "the cat", "max_tokens": 5, "temperature": 0}
    with BackgroundServer(llm, "demo") as srv, httpx.Client(base_url=srv.url, timeout=60) as c:
        failed = c.post("/v1/completions", json=body)
        assert failed.status_code == 500
        assert "injected kernel failure" in failed.json()["error"]["message"]
        ok = c.post("/v1/completions", json={**body, "ignore_eos": True, "return_token_ids": True})
        assert ok.status_code == 200, ok.text
        assert ok.json()["choices"][0]["token_ids"] == expected
    llm.scheduler.check_invariants()
    assert llm.manager.usage() == 0.0


def test_abandon_needs_the_pending_step() -> None:
    pytest.importorskip("torch")
    from hybridkv.cli.engine import load_llm
    from hybridkv.engine.sampling.sampler import SamplingParams
    from hybridkv.errors import SchedulerError

    llm = load_llm("demo")
    llm.add_request([1, 2, 3], SamplingParams(4))
    output = llm.scheduler.schedule({})
    cancelled = llm.scheduler.abandon(output)
    assert [r.status.name for r in cancelled] == ["CANCELLED"]
    with pytest.raises(SchedulerError, match="abandon"):
        llm.scheduler.abandon(output)
    llm.scheduler.check_invariants()
    assert llm.manager.usage() == 0.0
