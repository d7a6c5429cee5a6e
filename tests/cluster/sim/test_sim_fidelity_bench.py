"""``bench/sim_fidelity.py``'s controlled conditions: the long-prompt workload and the measure of
other processes' work (``CpuMonitor``) with its background load counted as outside work."""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "bench"))
import sim_fidelity  # noqa: E402


@pytest.fixture(scope="module")
def tokenizer():
    from thinkserve.workers.loader import resolve_model_path
    from thinkserve.workers.tokenizer import Tokenizer
    return Tokenizer.from_pretrained(resolve_model_path("tiny-reasoner"))


def test_long_prompts_are_worked_examples_before_the_problem(tokenizer):
    short = sim_fidelity.make_jobs(3.0, 20.0, 7, 1400, tokenizer)
    long = sim_fidelity.make_jobs(3.0, 20.0, 7, 1400, tokenizer, prompt_tokens=300, max_model_len=1536)
    assert [j["at"] for j in long] == [j["at"] for j in short] and len(long) > 20
    for s, j in zip(short, long):
        assert j["text"].endswith("\n" + s["text"])                  # the same problem, last
        assert j["prompt_len"] == len(tokenizer.encode(j["text"]))
        assert 300 <= j["prompt_len"] <= 450
        assert j["max_tokens"] == min(1400, 1536 - j["prompt_len"])
        assert s["max_tokens"] == 1400 and s["prompt_len"] < 30
    # Each request its own examples: no two prompts share their first line (no prefix reuse).
    firsts = [j["text"].split("\n", 1)[0] for j in long]
    assert len(set(firsts)) == len(firsts)


def test_pinned_layouts_give_each_engine_a_core_of_its_own():
    cores = sorted(os.sched_getaffinity(0))
    pd = sim_fidelity.setup_config("pd", 2, "x", pin=True)
    assert pd.pool("prefill").cpus == [[cores[0]]]
    assert pd.pool("short_decode").cpus == ([[c] for c in cores[1:]] or [[cores[0]]])
    mixed = sim_fidelity.setup_config("mixed", 2, "x", pin=True)
    assert mixed.pool("mixed").cpus == [[c] for c in cores] and mixed.pool("mixed").replicas == 2
    assert sim_fidelity.setup_config("mixed", 2, "x").pool("mixed").cpus is None


def _stat(pid: int) -> tuple[int, int]:
    """(nice, CPU ticks so far) of a process, from /proc."""
    with open(f"/proc/{pid}/stat") as f:
        rest = f.read().rsplit(")", 1)[1].split()
    return int(rest[16]), int(rest[11]) + int(rest[12])


def test_cpu_monitor_counts_the_background_load_as_outside_work_by_nice():
    # One loop at this process's own priority. It is a child of this process, which the monitor
    # leaves out with its descendants (the cluster it starts) unless named outside.
    procs = sim_fidelity.start_load(1, 0)
    pid = procs[0].pid
    try:
        time.sleep(0.3)
        monitor = sim_fidelity.CpuMonitor(interval=0.25, outside=[pid])
        nice, before = _stat(pid)
        t0 = time.monotonic()
        monitor.start()
        time.sleep(2.0)
        total = monitor.stop()
        loop = (_stat(pid)[1] - before) / os.sysconf("SC_CLK_TCK") / (time.monotonic() - t0)
    finally:
        sim_fidelity.stop_load(procs)
    assert all(p.poll() is not None for p in procs)
    assert nice == _stat(os.getpid())[0] and loop > 0.05        # it ran (other jobs share the cores)
    mean = lambda series: sum(v for _, v in series) / len(series)  # noqa: E731
    for (_, w), (_, u) in zip(total, monitor.unniced):
        assert 0.0 <= u <= w + 1e-9
    # Its work is in the total; among the un-niced only at nice 0 or below; weighted by
    # 1.25 ** -nice. (Tolerance: the monitor's windows are not exactly the loop's.)
    assert mean(total) > loop - 0.1
    if nice <= 0:
        assert mean(monitor.unniced) > loop - 0.1
    else:
        assert mean(total) - mean(monitor.unniced) > loop - 0.1
        assert mean(monitor.weighted) - mean(monitor.unniced) < mean(total) - mean(monitor.unniced)


QUIET = ROOT / "bench" / "data" / "sim_fidelity" / "quiet-20261203"


def _session(tmp_path, *names: str) -> Path:
    """A session folder under ``tmp_path`` with copies of these recorded runs of 2026-12-03's
    quiet sessions."""
    import shutil
    session = tmp_path / "session"
    session.mkdir()
    for name in names:
        shutil.copy(QUIET / name, session / name)
    return session


def test_replay_checks_each_run_as_is_and_calibrated_by_its_sessions_other_run(tmp_path):
    import json
    session = _session(tmp_path, "pd-seed40.json.gz", "pd-seed40.B.json.gz")  # run A is in the committed fit, B not
    (session / "unpaired.json.gz").write_bytes((QUIET / "pd-seed42.json.gz").read_bytes())
    out = tmp_path / "replay.json"
    assert sim_fidelity.main(["--replay", str(session), "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    runs = res["runs"]
    assert sorted(runs) == ["session/pd-seed40.B.json.gz", "session/pd-seed40.json.gz"]   # the unpaired run: none
    assert runs["session/pd-seed40.json.gz"]["in_fit"] and not runs["session/pd-seed40.B.json.gz"]["in_fit"]
    b = runs["session/pd-seed40.B.json.gz"]
    # The calibration of run B is run A's: the pd layout's prompt steps ran over their price.
    assert b["calibration"]["prompt_steps"] > 1.05
    for label in ("as_is", "calibrated"):
        assert set(b[label]) == set(sim_fidelity.METRICS) and all(abs(e) < 1.0 for e in b[label].values())
    s = res["summary"]
    assert s["held_out_runs"] == 1 and s["figures"] == 4
    assert s["within_15pct_calibrated"] == sum(abs(e) <= 0.15 for e in b["calibrated"].values())
    assert "held-out runs: 1" in out.with_suffix(".md").read_text()
    # the plot beside it, and the same plot again from the JSON alone (``--plot-replay``)
    png = out.with_suffix(".png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    again = tmp_path / "again.png"
    assert sim_fidelity.main(["--plot-replay", str(out), str(again)]) == 0
    assert again.read_bytes() == png


def test_replay_calibrated_by_the_run_itself(tmp_path):
    # ``--self-calibrated``: each run is also simulated calibrated by its own telemetry. In a session
    # whose run A is a copy of run B, calibrated by the other run is calibrated by itself, to the
    # digit; in a real session the two differ.
    import json
    import shutil
    session = _session(tmp_path, "mixed-seed42.json.gz", "mixed-seed42.B.json.gz")
    copy = tmp_path / "copy"
    copy.mkdir()
    for name in ("mixed-seed42.json.gz", "mixed-seed42.B.json.gz"):
        shutil.copy(QUIET / "mixed-seed42.B.json.gz", copy / name)
    out = tmp_path / "self.json"
    assert sim_fidelity.main(["--replay", str(session), str(copy), "--self-calibrated", "--noise-seeds", "2",
                              "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    for name in ("copy/mixed-seed42.json.gz", "copy/mixed-seed42.B.json.gz"):
        run = res["runs"][name]
        assert run["self_by_seed"] == run["calibrated_by_seed"]
    real = res["runs"]["session/mixed-seed42.B.json.gz"]
    assert real["self"] != real["calibrated"] and set(real["self"]) == set(sim_fidelity.METRICS)
    s = res["summary"]
    held = [v for v in res["runs"].values() if not v["in_fit"]]
    assert s["within_15pct_self"] == sum(abs(e) <= 0.15 for v in held for e in v["self"].values())
    assert len(s["within_15pct_self_by_seed"]) == 2
    assert "calibrated by the run itself" in out.with_suffix(".md").read_text()


def test_replay_with_several_noise_draws(tmp_path):
    # Two draws of the simulation's random parts: the first is the default's (the same errors as
    # a replay with one), the second differs; each draw counted, the errors' means over both.
    import json
    session = _session(tmp_path, "mixed-seed42.json.gz", "mixed-seed42.B.json.gz")
    one, two = tmp_path / "one.json", tmp_path / "two.json"
    assert sim_fidelity.main(["--replay", str(session), "--out", str(one)]) == 0
    assert sim_fidelity.main(["--replay", str(session), "--noise-seeds", "2", "--out", str(two)]) == 0
    a, b = json.loads(one.read_text()), json.loads(two.read_text())
    for name, run in b["runs"].items():
        assert run["calibrated"] == a["runs"][name]["calibrated"] == run["calibrated_by_seed"][0]
        assert run["calibrated_by_seed"][1] != run["calibrated_by_seed"][0]
    s = b["summary"]
    assert s["noise_seeds"] == 2 and s["within_15pct_calibrated_by_seed"][0] == s["within_15pct_calibrated"]
    errors = [run["calibrated_by_seed"][k]["tpot_p90"] for run in b["runs"].values() for k in (0, 1)]
    assert s["calibrated_errors"]["mixed"]["tpot_p90"]["mean"] == pytest.approx(sum(errors) / 4)
    assert "per noise draw" in two.with_suffix(".md").read_text()
    with pytest.raises(SystemExit):
        sim_fidelity.main(["--replay", str(session), "--noise-seeds", "0"])


def test_replay_counts_the_real_cluster_against_itself_beside_the_simulator(tmp_path):
    # Run B sent again twice (``--repeats 2``): B2 as it was (the same figures), B3 with every
    # request's tokens after the first 1.2x as far apart. The repeats are simulated calibrated by
    # run A like run B, and counted apart from the held-out runs.
    import gzip
    import json
    import shutil
    session = _session(tmp_path, "pd-seed40.json.gz", "pd-seed40.B.json.gz")
    run_b = sim_fidelity.fit_sim_cpu.load_trace(QUIET / "pd-seed40.B.json.gz")
    shutil.copy(QUIET / "pd-seed40.B.json.gz", sim_fidelity.run_path(session / "pd-seed40.json.gz", "B2"))
    slower = json.loads(json.dumps(run_b))
    for r in slower["requests"]:
        if r["end"] is not None and r["first"] is not None:
            r["end"] = r["first"] + 1.2 * (r["end"] - r["first"])
    b3 = sim_fidelity.run_path(session / "pd-seed40.json.gz", "B3")
    assert b3.name == "pd-seed40.B3.json.gz"
    b3.write_bytes(gzip.compress(json.dumps(slower).encode()))
    out = tmp_path / "replay.json"
    assert sim_fidelity.main(["--replay", str(session), "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    runs, s = res["runs"], res["summary"]
    b, b2, b3r = (runs[f"session/pd-seed40.{x}.json.gz"] for x in ("B", "B2", "B3"))
    assert "repeat_of" not in b and b2["repeat_of"] == b3r["repeat_of"] == "session/pd-seed40.B.json.gz"
    # The same requests and outside work, calibrated by the same run A: the same simulation.
    assert b2["calibrated"] == b["calibrated"] and b2["calibration"] == b["calibration"]
    for m in ("tpot_mean", "tpot_p90"):
        assert b3r["real"][m] == pytest.approx(1.2 * b["real"][m])
        assert 1 + b3r["calibrated"][m] == pytest.approx((1 + b["calibrated"][m]) / 1.2)
    # Held-out runs as without repeats: run B only (run A is in the committed fit).
    assert s["held_out_runs"] == 1 and s["figures"] == 4
    rep = s["repeatability"]
    assert (rep["workloads"], rep["real_runs"], rep["real_pairs"], rep["real_figures"]) == (1, 3, 3, 12)
    # B2 against B: every figure equal; B3 against B and B2: the TPOTs 20% over.
    for m, within in (("ttft_mean", 3), ("ttft_p90", 3), ("tpot_mean", 1), ("tpot_p90", 1)):
        f = rep["by_figure"][m]
        assert f["real_within_15pct"] == within and f["real_pairs"] == 3
        errors = [runs[n]["calibrated"][m] for n in ("session/pd-seed40.B.json.gz", "session/pd-seed40.B2.json.gz",
                                                     "session/pd-seed40.B3.json.gz")]
        assert f["sim_within_15pct_per_draw"] == sum(abs(e) <= 0.15 for e in errors)
        assert f["sim_max_abs"] == pytest.approx(max(map(abs, errors)))
    assert rep["real_within_15pct"] == 8
    assert "the real cluster against itself" in out.with_suffix(".md").read_text()
    # Run B is also simulated calibrated by its first repeat (B2, here a copy of it: the same as
    # calibrated by itself), and counted beside the repeat's real figures against run B's.
    assert "repeat" not in b2 and "repeat" not in b3r
    by_repeat = s["repeat"]
    assert (by_repeat["runs"], by_repeat["figures"], by_repeat["real_within_15pct"]) == (1, 4, 4)
    assert by_repeat["real_mean_abs"] == 0.0
    assert by_repeat["within_15pct_repeat_by_seed"] == [sum(abs(e) <= 0.15 for e in b["repeat"].values())]
    assert by_repeat["mean_abs_calibrated"] == pytest.approx(sum(map(abs, b["calibrated"].values())) / 4)
    assert "calibrated by B2 (the same requests" in out.with_suffix(".md").read_text()
    again = tmp_path / "again.json"
    assert sim_fidelity.main(["--replay", str(session), "--self-calibrated", "--out", str(again)]) == 0
    b = json.loads(again.read_text())["runs"]["session/pd-seed40.B.json.gz"]
    assert b["repeat"] == b["self"] != b["calibrated"]


def test_replay_calibrates_run_b_by_the_runs_before_and_after_it(tmp_path):
    # ``--after``: a run C of other requests after run B. Run B is also simulated calibrated by
    # run C alone and by runs A and C pooled; run C is no session's run A. With run C a copy of run
    # A, run C's calibration is run A's to the digit (pooled, the doubled counts can pass a factor's
    # minimum: not compared); with another run all three differ.
    import json
    import shutil
    same = _session(tmp_path, "pd-seed40.json.gz", "pd-seed40.B.json.gz")
    shutil.copy(QUIET / "pd-seed40.json.gz", sim_fidelity.run_path(same / "pd-seed40.json.gz", "C"))
    other = tmp_path / "other"
    other.mkdir()
    for name in ("pd-seed40.json.gz", "pd-seed40.B.json.gz"):
        shutil.copy(QUIET / name, other / name)
    shutil.copy(QUIET / "pd-seed42.json.gz", sim_fidelity.run_path(other / "pd-seed40.json.gz", "C"))
    out = tmp_path / "replay.json"
    assert sim_fidelity.main(["--replay", str(same), str(other), "--noise-seeds", "2", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    runs = res["runs"]
    assert sorted(runs) == sorted(f"{d}/pd-seed40.{x}json.gz" for d in ("session", "other") for x in ("", "B."))
    b = runs["session/pd-seed40.B.json.gz"]
    assert b["after_by_seed"] == b["calibrated_by_seed"] and len(b["bracketed_by_seed"]) == 2
    assert "after" not in runs["session/pd-seed40.json.gz"]                   # run B only
    b = runs["other/pd-seed40.B.json.gz"]
    assert b["after"] != b["calibrated"] and b["bracketed"] not in (b["after"], b["calibrated"])
    s = res["summary"]["bracketed"]
    assert (s["runs"], s["figures"]) == (2, 8)
    for label in ("calibrated", "after", "bracketed"):
        assert s[f"within_15pct_{label}_by_seed"] == [
            sum(abs(e) <= 0.15 for v in runs.values() if "bracketed" in v for e in v[f"{label}_by_seed"][d].values())
            for d in (0, 1)]
    assert "| runs A and C, around it |" in out.with_suffix(".md").read_text()


def test_machine_probe_measures_beside_the_cluster_and_stops():
    # The probe (bench/machine_probe.py) is a child of this process (CpuMonitor counts it as the
    # cluster's own work); it measures its unit every 0.125 s until stopped.
    probe = sim_fidelity.MachineProbe()
    try:
        deadline = time.monotonic() + 30.0           # torch's import, then the warm-up
        while not probe.samples(0.0, time.monotonic()) and time.monotonic() < deadline:
            time.sleep(0.2)
        t0 = time.monotonic()
        time.sleep(1.5)
        got = probe.samples(t0, time.monotonic())
        proc = probe._proc
    finally:
        probe.stop()
    assert proc.poll() is not None and probe.unit == "wide"
    assert 5 <= len(got) <= 30 and all(-1.0 <= t <= 1.6 and ms > 0 for t, ms in got)
    assert [t for t, _ in got] == sorted(t for t, _ in got)


def test_replay_reads_the_machines_speed_from_the_probe(tmp_path):
    # A session recorded with the probe beside it (2026-12-04, a changing hour: mixed seed 140):
    # the calibration carries the probe's level, and each run is simulated with its probe's
    # windows over that level; without the probe (the same runs, the probe taken out) the
    # calibration has none and the simulation draws the machine's slowness instead.
    import gzip
    import json
    data = ROOT / "bench" / "data" / "sim_fidelity" / "machine-20261204"
    with_probe, without = tmp_path / "probe", tmp_path / "none"
    for d in (with_probe, without):
        d.mkdir()
    for name in ("mixed140.json.gz", "mixed140.B.json.gz"):
        trace = json.loads(gzip.open(data / name).read())
        (with_probe / name).write_bytes(gzip.compress(json.dumps(trace).encode()))
        trace.pop("machine_probe")
        (without / name).write_bytes(gzip.compress(json.dumps(trace).encode()))
    out = tmp_path / "replay.json"
    assert sim_fidelity.main(["--replay", str(with_probe), str(without), "--out", str(out)]) == 0
    runs = json.loads(out.read_text())["runs"]
    a, b = runs["probe/mixed140.B.json.gz"], runs["none/mixed140.B.json.gz"]
    assert a["calibration"]["probe_ms"] > 0 and "probe_ms" not in b["calibration"]
    assert a["calibrated"] != b["calibrated"] and a["as_is"] == b["as_is"]


def test_a_probe_is_only_compared_with_a_probe_of_its_unit():
    # A run recorded before the unit was written down had the narrow one; a calibration keeps its
    # probe's unit, and a simulation replays a run's probe over the calibration's level only where
    # the two units are the same (else it draws the machine's slowness, as without a probe).
    import gzip
    import json
    import fit_sim_cpu
    import machine_probe
    data = ROOT / "bench" / "data" / "sim_fidelity" / "machine-20261204"
    a, b = (json.loads(gzip.open(data / name).read()) for name in ("mixed140.json.gz", "mixed140.B.json.gz"))
    assert fit_sim_cpu.probe_unit(a) == machine_probe.LEGACY_UNIT == "narrow" and machine_probe.UNIT == "wide"
    from thinkserve.cluster.sim.cost import CPU_FIT_PATH
    fit = json.loads(CPU_FIT_PATH.read_text())
    cal = fit_sim_cpu.calibrate(fit, a)
    assert cal["probe_unit"] == "narrow" and cal["probe_ms"] > 0
    series = fit_sim_cpu.machine_series_for(b, cal)
    assert series and series == fit_sim_cpu.machine_series(b, cal["probe_ms"])
    wide_b = {**b, "machine_probe_unit": "wide"}
    assert fit_sim_cpu.machine_series_for(wide_b, cal) == []
    assert fit_sim_cpu.machine_series_for(b, {k: v for k, v in cal.items() if k != "probe_ms"}) == []
    # a calibration from runs of two units has no probe level
    both = fit_sim_cpu.calibrate(fit, a, {**a, "machine_probe_unit": "wide"})
    assert "probe_ms" not in both and "probe_unit" not in both


def test_the_engine_probe_unit_is_the_engines_own_decode_step():
    # ``--unit engine``: the tiny-reasoner's model runner, as an instance builds it, decoding one
    # token for each of ENGINE_BATCH prefilled sequences at the same positions every call: the
    # same work each call (the same greedy tokens), and the engine's (its weights, its kernels).
    import machine_probe
    import torch
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        unit = machine_probe.engine_unit()
        first, second = unit(), unit()
    finally:
        torch.set_num_threads(threads)
    assert [t.seq_id for t in first.sampled] == list(range(machine_probe.ENGINE_BATCH))
    assert first.sampled == second.sampled


def test_a_warm_unit_times_the_last_of_its_back_to_back_calls():
    import machine_probe
    assert {"wide-warm", "engine-warm", "narrow-warm"} <= set(machine_probe.UNITS)
    calls = []

    def unit():
        calls.append(time.thread_time_ns())
        if len(calls) < machine_probe.WARM_CALLS:       # the untimed calls: work the timed one must not see
            sum(range(300_000))
    ms = machine_probe.measure(unit, machine_probe.WARM_CALLS)
    assert len(calls) == machine_probe.WARM_CALLS and 0 <= ms < 5.0
    alone = machine_probe.measure(lambda: sum(range(300_000)))
    assert alone > ms


def test_a_run_recorded_with_several_probes_replays_with_any_of_them(tmp_path):
    # The wide-probe sessions carry the narrow unit's samples beside the wide one's
    # (machine_probe_narrow): ``--replay-probe narrow`` replays them with the narrow probe, the
    # calibration's level and unit then the narrow probe's; a unit the run lacks leaves it out.
    import gzip
    import json
    import shutil
    import fit_sim_cpu
    data = ROOT / "bench" / "data" / "sim_fidelity" / "wide-probe-20261206"
    run = json.loads(gzip.open(data / "pd312.B.json.gz").read())
    assert fit_sim_cpu.with_probe(run, None) is run and fit_sim_cpu.with_probe(run, "wide") is run
    narrow = fit_sim_cpu.with_probe(run, "narrow")
    assert narrow["machine_probe_unit"] == "narrow" and narrow["machine_probe"] == run["machine_probe_narrow"]
    with pytest.raises(ValueError, match="no engine probe recorded"):
        fit_sim_cpu.with_probe(run, "engine")
    from thinkserve.cluster.sim.cost import CPU_FIT_PATH
    for name in ("pd312.json.gz", "pd312.B.json.gz"):
        shutil.copy(data / name, tmp_path / name)
    out, left = {}, []
    for probe in ("wide", "narrow", "engine"):
        out[probe] = sim_fidelity.replay([str(tmp_path)], CPU_FIT_PATH, tmp_path / f"{probe}.json",
                                         progress=left.append, probe=probe)
    runs = {p: json.loads((tmp_path / f"{p}.json").read_text())["runs"] for p in ("wide", "narrow")}
    assert out["narrow"]["probe"] == "narrow" and out["narrow"]["held_out_runs"] == out["wide"]["held_out_runs"] == 2
    for name, r in runs["narrow"].items():
        level = {p: runs[p][name]["calibration"]["probe_ms"] for p in runs}
        assert 1.0 < level["narrow"] < level["wide"]       # the narrow unit is the quicker one
    assert out["engine"]["held_out_runs"] == 0 and any("no engine probe recorded" in m for m in left)


def test_attribution_swaps_one_group_of_factors_and_agrees_with_the_replay(tmp_path):
    # ``bench/sim_fidelity_attribution.py``: a group's own level factors are rescaled to the other
    # run's probe level, its spreads and the keys of other groups are left as the other run's; and
    # the prediction and the run's own calibration it simulates are the replay's, to the digit.
    import json
    import shutil
    import sim_fidelity_attribution as attribution
    other = {"decode_steps": 1.0, "decode_co_steps": 0.9, "decode_per_seq": 1.1, "engines": [1.0, 1.0],
             "handoff": 1.0, "handoff_spread": 0.8, "slow_spread": 1.2, "probe_ms": 2.5}
    own = {"decode_steps": 1.2, "decode_co_steps": 0.6, "decode_per_seq": 2.0, "engines": [0.9, 1.1],
           "handoff": 1.4, "handoff_spread": 0.5, "slow_spread": 1.5, "probe_ms": 2.0}
    v = attribution.variants(other, own)
    assert v["other"] is other and v["own"] is own
    assert v["decode"]["decode_steps"] == pytest.approx(1.5) and v["decode"]["decode_co_steps"] == pytest.approx(0.75)
    assert v["decode"]["decode_per_seq"] == 2.0 and v["decode"]["engines"] == [0.9, 1.1]   # not levels
    assert v["decode"]["handoff"] == 1.0 and v["decode"]["probe_ms"] == 2.5                # the other's
    assert v["handoff"]["handoff"] == pytest.approx(1.75) and v["handoff"]["handoff_spread"] == 0.5
    assert v["slow"]["slow_spread"] == 1.5 and v["slow"]["decode_steps"] == 1.0
    # Without a probe on either side, nothing is rescaled.
    plain = attribution.variants({k: x for k, x in other.items() if k != "probe_ms"}, own)
    assert plain["decode"]["decode_steps"] == 1.2

    session = tmp_path / "session"
    session.mkdir()
    for name in ("pd-seed42.json.gz", "pd-seed42.B.json.gz"):
        shutil.copy(QUIET / name, session / name)
    from thinkserve.cluster.sim.cost import CPU_FIT_PATH
    rows = attribution.attribute([str(session)], "pd", 1, CPU_FIT_PATH, progress=lambda _: None)
    assert [r["run"] for r in rows] == ["session/pd-seed42.json.gz", "session/pd-seed42.B.json.gz"]
    out = tmp_path / "replay.json"
    assert sim_fidelity.main(["--replay", str(session), "--self-calibrated", "--out", str(out)]) == 0
    replayed = json.loads(out.read_text())["runs"]
    for row in rows:
        assert row["errors"]["other"] == replayed[row["run"]]["calibrated"]
        assert row["errors"]["own"] == replayed[row["run"]]["self"]
        assert set(row["errors"]) == {"other", "own", *attribution.GROUPS}
    summary = attribution.summary(rows)
    assert summary["tpot_p90"]["other"]["mean_abs"] == pytest.approx(
        sum(abs(r["errors"]["other"]["tpot_p90"]) for r in rows) / 2)
