"""``bench serve``'s modes as the rankers and routers are configured for them: the two baselines (full
inference; prefix caching without pre-inference), relay and its ablations, and the trace they share."""

import argparse
from pathlib import Path

import pytest

from grstack.runtime.bench.serve import (
    BASELINES,
    DEVICE_CACHE_MB,
    DRAM_CACHE_MB,
    DRAM_TTL_S,
    KV_BYTES_PER_TOKEN,
    MODES,
    Settings,
    ranker_args,
    router_config,
    versus,
)
from grstack.runtime.serve.cli import MB, ranker_config, register

pytestmark = pytest.mark.unit


def ranker(mode: str):
    parser = argparse.ArgumentParser()
    register(parser)
    return ranker_config(parser.parse_args(["ranker", "--checkpoint", "m.pt", *ranker_args(mode)]), max_len=1024)


def test_prefix_cache_keeps_its_ranks_prefixes_on_the_device_and_pre_infers_nothing():
    cfg, router = ranker("prefix_cache"), router_config("prefix_cache", ["http://r0", "http://r1"], 100.0)
    assert cfg.cache_misses is True  # a rank's prefix is kept for the user's next request
    assert cfg.device_cache_bytes == DEVICE_CACHE_MB * MB and cfg.dram_cache_bytes == 0  # device tier only
    assert router.relay is False  # the retrieval signal is ignored: no trigger, nothing pre-inferred
    assert router.affinity is True  # a user's next rank goes where her last one left its prefix


def test_full_inference_keeps_nothing_and_relay_has_every_tier():
    full, relay = ranker("baseline"), ranker("relay")
    assert full.cache_misses is False and router_config("baseline", ["http://r0"], 100.0).relay is False
    assert relay.cache_misses is True and relay.dram_cache_bytes == DRAM_CACHE_MB * MB
    assert router_config("relay", ["http://r0"], 100.0).relay is True
    assert ranker("no_expander").dram_cache_bytes == 0
    assert set(BASELINES) <= set(MODES) and "prefix_cache" in MODES


def test_every_mode_has_the_ttl_and_device_tier_the_trace_is_built_for(tmp_path: Path):
    s = Settings(users=200, lengths=[256, 512], length_qps=40.0, qps=[40.0], qps_length=512, repeats=1,
                 slo_ms=100.0, gap_ms=50.0, measured=100, warmup=10, seed=0, out=tmp_path, rankers=2)
    t = s.trace_config(512, 40.0, 0)
    assert {ranker(m).dram_ttl_s for m in MODES} == {DRAM_TTL_S} == {t.dram_ttl_s}
    assert t.device_cache_bytes == 2 * DEVICE_CACHE_MB * MB and t.kv_bytes_per_token == KV_BYTES_PER_TOKEN
    assert t.pressure_length == 256 and t.follow_through < 1.0 and t.length_dist == "kuairand"


def test_kv_bytes_per_token_are_the_benchmark_models(tmp_path: Path):
    from grstack.runtime.serve import load_ranking_model, write_untrained_model
    from grstack.runtime.serve.kv_arena import bytes_per_token

    model, _ = load_ranking_model(write_untrained_model(tmp_path / "m.pt", num_items=50, max_len=64))
    assert bytes_per_token(model) == KV_BYTES_PER_TOKEN


def test_comparisons_have_the_same_fields():
    relay = {"max_len_at_slo": 1024, "max_qps_at_slo": 120.0}
    assert versus(relay, {"max_len_at_slo": 512, "max_qps_at_slo": 40.0}) == {"max_len_ratio": 2.0,
                                                                               "slo_qps_ratio": 3.0}
    assert versus(relay, {"max_len_at_slo": None, "max_qps_at_slo": 60.0}) == {"max_len_ratio": None,
                                                                               "slo_qps_ratio": 2.0}


def test_the_uniform_trace_is_the_earlier_one_and_the_protocol_is_the_default(tmp_path: Path):
    common = dict(users=300, lengths=[256], length_qps=20.0, qps=[20.0], qps_length=256, repeats=1, slo_ms=100.0,
                  gap_ms=50.0, measured=100, warmup=10, seed=0, out=tmp_path)
    protocol = Settings(**common).trace_config(256, 20.0, 0)
    assert (protocol.length_dist, protocol.follow_through, protocol.keep_sessions_apart) == ("kuairand", 0.8, True)
    assert protocol.device_cache_bytes > 0  # sized for cache pressure
    uniform = Settings(**common, trace_kind="uniform").trace_config(256, 20.0, 0)
    assert (uniform.length_dist, uniform.follow_through, uniform.keep_sessions_apart) == ("fixed", 1.0, False)
    assert uniform.device_cache_bytes == 0 and uniform.dram_ttl_s == DRAM_TTL_S  # reuse still counted at the TTL
