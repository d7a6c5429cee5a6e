from pathlib import Path

import pytest

from thinkserve.cluster.config import ConfigError, load_config, parse_config

ROOT = Path(__file__).resolve().parents[2]


def error_of(data) -> str:
    with pytest.raises(ConfigError) as e:
        parse_config(data)
    return str(e.value)


def test_defaults_are_servable_and_loopback():
    cfg = parse_config({})
    assert cfg.model == "tiny-reasoner"
    assert cfg.frontend.host == "127.0.0.1"
    assert [cfg.pool(p).replicas for p in ("prefill", "short_decode", "long_decode", "mixed")] == [1, 1, 1, 0]
    assert cfg.engine_config("prefill").role == "prefill"
    assert cfg.engine_config("long_decode").role == "decode"
    assert cfg.engine_config("mixed").role == "mixed"


def test_errors_name_the_field():
    assert error_of({"pools": {"prefill": {"replicas": -1}}}).startswith("pools.prefill.replicas:")
    assert error_of({"pools": {"prefil": {}}}).startswith("pools.prefil: Extra inputs")
    assert error_of({"limits": {"max_queued_requests": "many"}}).startswith("limits.max_queued_requests:")
    assert error_of({"frontend": {"port": 70000}}).startswith("frontend.port:")
    assert error_of({"engine": {"block_size": 0}}) == "engine: block_size must be in [1, 1024], got 0"
    assert error_of({"pools": {"long_decode": {"engine": {"preemption_mode": "drop"}}}}).startswith(
        "pools.long_decode.engine: preemption_mode must be one of")
    assert error_of({"engine": {"role": "prefill"}}).startswith("engine.role: Extra inputs")
    assert error_of([1, 2]) == "config: expected a mapping at the top level, got list"


def test_cross_field_checks():
    assert error_of({"pools": {"prefill": {"replicas": 0}}}).startswith("pools: nothing can serve")
    assert "block_size" in error_of({"pools": {"long_decode": {"engine": {"block_size": 32}}}})
    # colocated only is fine
    cfg = parse_config({"pools": {"prefill": {"replicas": 0}, "short_decode": {"replicas": 0},
                                  "long_decode": {"replicas": 0}, "mixed": {"replicas": 2}}})
    assert cfg.pool("mixed").replicas == 2


def test_pool_core_sets_are_checked_and_shared_out_evenly():
    from thinkserve.cluster.controller import core_set_for

    assert error_of({"pools": {"prefill": {"cpus": []}}}).startswith("pools.prefill.cpus: empty")
    assert error_of({"pools": {"mixed": {"cpus": [[0], []]}}}).startswith("pools.mixed.cpus: entry 1 is empty")
    assert error_of({"pools": {"mixed": {"cpus": [[1, 1]]}}}).startswith("pools.mixed.cpus: entry 0 [1, 1]: core ids")
    assert error_of({"pools": {"mixed": {"cpus": [[-2]]}}}).startswith("pools.mixed.cpus: entry 0 [-2]: core ids")
    assert error_of({"pools": {"mixed": {"cpus": "0-3"}}}).startswith("pools.mixed.cpus:")
    sets = parse_config({"pools": {"mixed": {"replicas": 2, "cpus": [[0], [1, 2]]}}}).pool("mixed").cpus
    assert sets == [[0], [1, 2]]
    # each new instance takes the set the fewest of the pool's instances hold, the first such
    held: list[tuple[int, ...]] = []
    for want in [(0,), (1, 2), (0,), (1, 2)]:
        got = core_set_for(sets, held)
        assert got == want
        held.append(got)
    assert core_set_for(sets, [(1, 2), (0,), (0,)]) == (1, 2)     # a replacement fills the gap
    assert core_set_for(None, held) == ()


def test_pool_engine_overrides_merge_over_defaults():
    cfg = parse_config({"engine": {"num_device_blocks": 100, "max_num_seqs": 8},
                        "pools": {"long_decode": {"engine": {"num_device_blocks": 400}}}})
    assert cfg.engine_config("long_decode").num_device_blocks == 400
    assert cfg.engine_config("long_decode").max_num_seqs == 8
    assert cfg.engine_config("short_decode").num_device_blocks == 100


def test_yaml_files(tmp_path):
    cfg = load_config(ROOT / "deploy" / "local.yaml")
    assert cfg.frontend.host == "127.0.0.1"
    bad = tmp_path / "bad.yaml"
    bad.write_text("pools: {prefill: {replicas: [}")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "missing.yaml")


def test_kv_transport_is_auto_by_default_and_checked():
    assert parse_config({}).kv_transport == "auto"
    assert parse_config({"kv_transport": "tcp"}).kv_transport == "tcp"
    assert error_of({"kv_transport": "rdma"}).startswith("kv_transport: Input should be 'auto', 'tcp', 'shm' or 'collective'")


def test_the_spill_rule_reaches_the_conductor_and_is_checked():
    c = parse_config({"router": {"policy": "conductor", "spill_long_max_probability": 0.25,
                                 "length_predictor": "none"}}).make_policy()
    assert c.config.spill_long_max_probability == 0.25
    assert parse_config({"router": {"policy": "conductor", "length_predictor": "none"}}).make_policy() \
        .config.spill_long_max_probability == 0.5
    assert error_of({"router": {"spill_long_max_probability": 2}}).startswith("router.spill_long_max_probability:")
