"""EP in the simulator (``sim.ep``): EP N with P prefill instances against EP N/2 with 2P on the
same GPUs, by the cost formula on a saturated synthetic trace, the KV budgets from the planner's
memory formula, the CLI, and the refusals."""

from __future__ import annotations

import functools
import json
import random
from pathlib import Path

import pytest
from typer.testing import CliRunner

from swaserve.cli import app
from swaserve.kvcache.hashing import block_hashes
from swaserve.sched.ep_cost import EPHardware, ep_prefill
from swaserve.shapes import model_config, shape
from swaserve.sim.ep import EPDeployment, EPSetup, compare
from swaserve.sim.run import deployment, simulate
from swaserve.sim.workload import SimRequest, Workload

DEP = deployment("mimo-v2-flash-h200")
FLASH = model_config(shape("MiMo-V2-Flash"))


def burst(n: int, tokens: int) -> Workload:
    """``n`` unrelated ``tokens``-token prompts at t = 0, one output token each (no decode)."""
    rng = random.Random(3)
    reqs = []
    for i in range(n):
        p = [rng.randrange(10, 250) for _ in range(tokens)]
        reqs.append(SimRequest(str(i), 0.0, tokens, 1, block_hashes(p, 64), functools.partial(list, p)))
    return Workload("burst", reqs, 64)


def test_ep_deployment_kv_budget_and_cost() -> None:
    d = EPDeployment(DEP, 4, EPSetup())
    # 4 x (0.9 x 141 GB - 6.97B x 2 B non-expert - 8 GB reserve - 302.8 GB / 4 experts)
    room = 0.9 * 141e9 - 6_971_406_720 * 2 - 8e9 - 47 * 256 * 3 * 4096 * 2048 / 4
    assert d.deployment.device_bytes == int(4 * room) and round(room / 1e9, 2) == 29.26
    assert d.deployment.cost.prefill_token_s == ep_prefill(FLASH, 4, EPHardware()).token_s
    assert d.deployment.prefill_gpus == 4 and "EP 4" in d.describe()
    with pytest.raises(ValueError, match="cannot hold"):
        EPDeployment(DEP, 2, EPSetup())  # 151.4 GB of experts per GPU
    with pytest.raises(ValueError, match="GPU deployment"):
        EPDeployment(deployment("cpu-tiny"), 4, EPSetup())
    with pytest.raises(ValueError, match="divide"):
        EPDeployment(DEP, 3, EPSetup())
    assert EPDeployment(DEP, 8, EPSetup(balance={8: 0.5})).prefill.balance == 0.5


def test_halving_ep_16_to_8_with_twice_the_instances_by_the_formula() -> None:
    """8 prompts of 4096 tokens at once, round robin. EP 16 x 1 instance serves them one after
    another; EP 8 x 2 instances serve 4 each. Each prefill takes base + token x n + attn x n (n+1)/2
    with the EP's token term (EP 16 spans 2 nodes: RDMA) and the full-attention term scaled by the
    GPUs (the preset's 8-GPU 1.16e-10 s per pair)."""
    n = 4096
    work = burst(8, n)
    setup = EPSetup()
    _, rows = compare(work, 1, 1, "round_robin", DEP, 16, setup, time_scale=1.0)

    def took(ep: int) -> float:
        tok = ep_prefill(FLASH, ep, setup.hw).token_s
        return 0.010 + tok * n + 1.16e-10 * 8 / ep * n * (n + 1) / 2

    t16, t8 = took(16), took(8)
    assert t16 == pytest.approx(0.010 + 8.481e-6 * 4096 + 0.58e-10 * 4096 * 4097 / 2, rel=1e-3)
    ep16, ep8 = rows
    assert (ep16["prefill_ep"], ep16["prefill"], ep8["prefill_ep"], ep8["prefill"]) == (16, 1, 8, 2)
    assert ep16["prefill_gpus"] == ep8["prefill_gpus"] == 16
    assert ep16["prompt_tok_s"] == pytest.approx(8 * n / (8 * t16), rel=1e-3)  # last first token at 8 t16
    assert ep8["prompt_tok_s"] == pytest.approx(8 * n / (4 * t8), rel=1e-3)
    assert ep8["prompt_tok_s"] / ep16["prompt_tok_s"] == pytest.approx(2 * t16 / t8, rel=1e-3)
    assert ep8["prompt_tok_s"] > 1.35 * ep16["prompt_tok_s"]
    # mean TTFT: (1 + ... + 8) / 8 x t16 = 4.5 t16 against (1 + ... + 4) / 4 x t8 = 2.5 t8
    assert ep16["ttft_mean"] == pytest.approx(4.5 * t16, rel=1e-3)
    assert ep8["ttft_mean"] == pytest.approx(2.5 * t8, rel=1e-3) and ep8["ttft_mean"] < ep16["ttft_mean"]
    assert ep8["hit_rate"] == ep16["hit_rate"] == 0.0


def test_compare_keeps_the_arrivals_of_ep_n_and_the_presets_without_ep() -> None:
    work = burst(4, 1024)
    for r in work.requests:
        r.arrival = float(r.rid)  # 1 s apart: a time span to scale
    deps, rows = compare(work, 1, 1, "round_robin", DEP, 8, EPSetup(), load=0.5)
    assert rows[0]["time_scale"] == rows[1]["time_scale"] and rows[0]["load"] == 0.5
    assert [d.ep for d in deps] == [8, 4]
    plain = simulate(work, 1, 1, "round_robin", DEP, time_scale=1.0)
    assert plain["deployment"] == "mimo-v2-flash-h200" and DEP.cost.prefill_token_s == 7.6e-6
    with pytest.raises(ValueError, match="even EP"):
        compare(work, 1, 1, "round_robin", DEP, 5, EPSetup())


def test_sim_cli_ep_compare(tmp_path: Path) -> None:
    trace = tmp_path / "t.jsonl"
    rows = [
        {"timestamp": i * 500, "input_length": 1024, "output_length": 2, "hash_ids": [i, 100 + i]}
        for i in range(12)
    ]
    trace.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "ep.json"
    base = ["sim", "--trace", str(trace), "--prefill", "1", "--decode", "1"]
    r = CliRunner().invoke(
        app, [*base, "--prefill-ep", "16", "--ep-compare", "--balance", "16=0.85", "--json", str(out)]
    )
    assert r.exit_code == 0, r.output
    assert "153 GB/s NVLink, 43 GB/s RDMA" in r.output and "balance EP 16: 0.85" in r.output
    assert "EP 8 x 2 vs EP 16 x 1" in r.output
    doc = json.loads(out.read_text())
    assert [(x["prefill_ep"], x["prefill"], x["prefill_gpus"]) for x in doc] == [(16, 1, 16), (8, 2, 16)]
    one = CliRunner().invoke(app, [*base, "--prefill-ep", "8"])
    assert one.exit_code == 0 and "EP 8:" in one.output
    for bad, msg in (
        (["--ep-compare"], "needs --prefill-ep"),
        (["--prefill-ep", "2"], "cannot hold"),
        (["--prefill-ep", "8", "--deployment", "cpu-tiny"], "GPU deployment"),
        (["--prefill-ep", "8", "--balance", "8"], "EP=BALANCE"),
    ):
        r = CliRunner().invoke(app, [*base, *bad])
        assert r.exit_code == 2 and msg in r.output, (bad, r.output)
