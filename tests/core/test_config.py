"""EngineConfig in sections: the flat option names map one to one onto section fields and
round-trip, unknown names are refused by name, each section checks its own fields with
messages naming the flat option, and the checks across sections run in EngineConfig."""

from __future__ import annotations

import re
from dataclasses import MISSING, fields

import pytest

from specserve.core.config import FLAG_FIELDS, EngineConfig, flag_fields, shipped_head_path
from specserve.core.config_sections import (
    CacheConfig,
    ExecutionConfig,
    ModelLoadConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
)
from specserve.core.errors import ConfigError
from specserve.engine_args import ENGINE_FLAGS, add_engine_args, flag_message

DEFAULTS = {name: f.default for name, f in flag_fields().items()}

# Every flat option at a value other than its default, already in normal form (so the
# config keeps it as given): a flag the table drops or maps wrong cannot come back. The KV
# cache is sized by kv_cache_bytes or num_kv_pages, never both: each round-trips without
# the other.
EVERY_FLAG = {
    "model": "some/model",
    "load_format": "dummy",
    "dtype": "bfloat16",
    "device": "cpu",
    "page_size": 32,
    "kv_cache_bytes": 2**20,
    "kv_cache_memory_fraction": 0.5,
    "num_kv_pages": 64,
    "disable_prefix_caching": True,
    "max_num_seqs": 8,
    "max_num_batched_tokens": 512,
    "max_model_len": 1024,
    "tensor_parallel_size": 4,
    "nnodes": 2,
    "node_rank": 1,
    "dist_init_addr": "10.0.0.1:29500",
    "seed": 7,
    "speculative_algorithm": "eagle3",  # (head_parallel below is read by eagle3 only)
    "speculative_draft_model_path": "some/head",
    "speculative_num_steps": 5,
    "speculative_policy": "schedule",
    "speculative_schedule": "1:4,16:2,64:0",
    "speculative_simulate_acceptance": 2.5,
    "speculative_head_parallel": "sharded",
    "speculative_trace_file": "trace.json",  # (a file in the working folder)
    "attention_backend": "torch",
    "disable_cuda_graph": True,
    "disable_gemv": True,
    "disable_gemv_tuning": True,
    "disable_batch_invariance": True,
    "disable_verify_tiles": True,
    "disable_pdl": True,
    "gemv_stream_k": True,
    "disable_fusion": True,
    "overlap_schedule": "off",
    "disable_overlap_schedule": True,
    "cuda_graph_max_batch": 64,
    "cuda_graph_max_tokens": 0,
    "grammar_workers": 3,
    "debug_tp_check": True,
}


def test_every_flag_maps_to_exactly_one_section_field():
    section_fields = {
        (section.name, f.name)
        for section in fields(EngineConfig)
        for f in fields(section.default_factory)
    }
    targets = list(FLAG_FIELDS.values())
    assert len(set(targets)) == len(targets), "two flags share a field"
    assert set(targets) == section_fields, "a field without a flag, or a flag without a field"
    assert all(f.default is not MISSING for f in flag_fields().values())


def _without(flags: dict, name: str) -> dict:
    return {k: v for k, v in flags.items() if k != name}


@pytest.mark.parametrize(
    "given",
    [
        _without(EVERY_FLAG, "kv_cache_bytes"),
        _without(EVERY_FLAG, "num_kv_pages"),
        {"speculative_algorithm": "ngram", "speculative_policy": "fixed"},
        {"speculative_algorithm": None, "speculative_policy": "off", "page_size": 8},
        {"model": "m", "speculative_algorithm": None, "speculative_policy": "off", "seed": 3},
    ],
)
def test_flat_round_trip(given):
    assert set(EVERY_FLAG) == set(FLAG_FIELDS)
    assert all(EVERY_FLAG[name] != DEFAULTS[name] for name in FLAG_FIELDS)
    config = EngineConfig.from_flags(**given)
    assert config.flags() == {**DEFAULTS, **given}
    assert list(config.flags()) == list(FLAG_FIELDS)  # the CLI's order
    for name, value in given.items():  # each lands in its own section's field
        section, attr = FLAG_FIELDS[name]
        assert getattr(getattr(config, section), attr) == value
    assert EngineConfig.from_flags(**config.flags()) == config


def test_defaults_resolve_speculation_and_round_trip():
    config = EngineConfig.from_flags()
    assert config == EngineConfig()
    assert EngineConfig.from_flags(**config.flags()) == config
    head = shipped_head_path()
    assert config.speculative.algorithm == "eagle3"  # the embedded model's shipped head
    assert config.speculative.draft_model_path == str(head)
    assert config.speculative.policy == "goodput"
    assert config.flags() == {
        **DEFAULTS,
        "speculative_algorithm": "eagle3",
        "speculative_draft_model_path": str(head),
        "speculative_policy": "goodput",
    }
    other = EngineConfig.from_flags(model="some/model")  # other models: no speculation
    assert other.speculative.algorithm is None and other.speculative.policy == "off"
    dummy = EngineConfig.from_flags(load_format="dummy")  # random weights: nor here
    assert dummy.speculative.algorithm is None


def test_cli_flags_are_the_flat_names_with_section_defaults():
    import argparse

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args([])
    assert list(ENGINE_FLAGS) == list(FLAG_FIELDS)
    assert {name: getattr(args, name) for name in FLAG_FIELDS} == DEFAULTS


def test_an_unknown_flat_name_is_refused_by_name():
    with pytest.raises(TypeError, match="unknown engine option.*'speculative_steps'"):
        EngineConfig.from_flags(speculative_steps=3)
    with pytest.raises(TypeError, match="'size_bytes'"):  # a field's name is not a flag
        EngineConfig.from_flags(size_bytes=2**20)
    from specserve.llm import LLM

    with pytest.raises(TypeError, match="'pages'"):  # before anything loads
        LLM(pages=4)


SECTION_ERRORS = [
    (ModelLoadConfig, dict(dtype="fp8"), "dtype must be auto, float32"),
    (ModelLoadConfig, dict(device="gpu0"), "device must be auto, cpu, cuda or cuda:N"),
    # devices torch knows that the engine does not run on (mps failed deep in the loading)
    (ModelLoadConfig, dict(device="mps"), "device must be auto, cpu, cuda or cuda:N"),
    (ModelLoadConfig, dict(device="meta"), "device must be auto, cpu, cuda or cuda:N"),
    (ModelLoadConfig, dict(format="random"), "load_format must be one of auto, dummy"),
    (CacheConfig, dict(page_size=0), "page_size must be >= 1"),
    (CacheConfig, dict(num_pages=0), r"num_kv_pages must be >= 2 \(page 0 is scratch\)"),
    (CacheConfig, dict(num_pages=1), r"num_kv_pages must be >= 2"),  # (once refused loaded)
    (
        CacheConfig,
        dict(num_pages=8, size_bytes=2**20),  # (the pages won without a word)
        "kv_cache_bytes and num_kv_pages both size the KV cache; give one",
    ),
    (CacheConfig, dict(size_bytes=0), "kv_cache_bytes must be positive"),
    (CacheConfig, dict(memory_fraction=1.5), r"kv_cache_memory_fraction must be in \(0, 1\]"),
    (SchedulerConfig, dict(max_num_seqs=0), "max_num_seqs must be >= 1"),
    (SchedulerConfig, dict(max_num_batched_tokens=0), "max_num_batched_tokens must be >= 1"),
    (ParallelConfig, dict(tensor_parallel_size=0), "tensor_parallel_size must be >= 1"),
    (ParallelConfig, dict(tensor_parallel_size=4, nnodes=3), "nnodes must divide"),
    (ParallelConfig, dict(nnodes=1, node_rank=1), r"node_rank must be in \[0, nnodes\)"),
    (ParallelConfig, dict(tensor_parallel_size=2, nnodes=2), "nnodes > 1 needs dist_init_addr"),
    (ParallelConfig, dict(dist_init_addr="no-port"), "dist_init_addr must be host:port"),
    (SpeculativeConfig, dict(algorithm="medusa"), "speculative_algorithm must be auto, eagle3"),
    (SpeculativeConfig, dict(num_steps=17), r"speculative_num_steps must be in \[1, 16\]"),
    (SpeculativeConfig, dict(num_steps=0), r"speculative_num_steps must be in \[1, 16\]"),
    (SpeculativeConfig, dict(policy="sometimes"), "speculative_policy must be goodput, fixed"),
    (
        SpeculativeConfig,
        dict(head_parallel="split"),
        "speculative_head_parallel must be replicated or sharded",
    ),
    (
        SpeculativeConfig,
        dict(algorithm="ngram", policy="schedule"),
        "speculative_policy schedule needs speculative_schedule",
    ),
    (
        SpeculativeConfig,
        dict(num_steps=3, simulate_acceptance=4.5),
        "speculative_simulate_acceptance is a per-token acceptance rate",
    ),
    (SchedulerConfig, dict(max_model_len=0), "max_model_len must be >= 1"),
    (SchedulerConfig, dict(max_model_len=-5), "max_model_len must be >= 1"),
    (
        SpeculativeConfig,
        dict(algorithm="ngram", policy="schedule", schedule="garbage"),
        "speculative_schedule 'garbage' must look like",
    ),
    (
        SpeculativeConfig,
        dict(algorithm="ngram", policy="schedule", schedule="1:2,"),
        "must look like",
    ),
    (
        SpeculativeConfig,
        dict(algorithm="ngram", policy="schedule", schedule="1:99"),
        r"draft lengths lie in \[0, speculative_num_steps = 3\]",
    ),
    (
        SpeculativeConfig,
        dict(algorithm="ngram", policy="schedule", schedule="1:-2"),
        "draft lengths lie in",
    ),
    (
        SpeculativeConfig,
        dict(algorithm="ngram", policy="fixed", schedule="1:2"),
        "speculative_schedule is speculative_policy schedule's table",
    ),
    (
        SpeculativeConfig,
        dict(algorithm="ngram", policy="schedule", schedule="1:1,1:3"),
        "speculative_schedule '1:1,1:3' gives a batch size two draft lengths",
    ),
    (ExecutionConfig, dict(cuda_graph_max_tokens=-1), "cuda_graph_max_tokens must be >= 0"),
    (ExecutionConfig, dict(cuda_graph_max_batch=-1), "cuda_graph_max_batch must be >= 1"),
    (ExecutionConfig, dict(cuda_graph_max_batch=0), "disable_cuda_graph runs every step"),
    (ExecutionConfig, dict(attention_backend="flash"), "attention_backend must be auto, torch"),
    (ExecutionConfig, dict(overlap_schedule="sometimes"), "overlap_schedule must be auto, on"),
    (
        ExecutionConfig,
        dict(overlap_schedule="on", disable_overlap_schedule=True),
        "disable_overlap_schedule contradicts overlap_schedule on",
    ),
]


@pytest.mark.parametrize("section, kwargs, message", SECTION_ERRORS)
def test_sections_check_their_fields_in_flat_words(section, kwargs, message):
    with pytest.raises(ConfigError, match=message) as err:
        section(**kwargs)
    assert str(err.value).split(" ", 1)[0] in FLAG_FIELDS  # the option as users name it
    # the same refusal through the flat names, worded as the flag on the command line
    types = {f.name: f.default_factory for f in fields(EngineConfig)}
    flat_name = {(types[sec], attr): flat for flat, (sec, attr) in FLAG_FIELDS.items()}
    flat = {flat_name[(section, attr)]: value for attr, value in kwargs.items()}
    with pytest.raises(ConfigError, match=message) as err:
        EngineConfig.from_flags(**flat)
    assert flag_message(str(err.value), ENGINE_FLAGS).startswith("--")


def test_checks_across_sections():
    with pytest.raises(ConfigError, match="speculative_algorithm draft needs "):
        EngineConfig.from_flags(speculative_algorithm="draft")
    with pytest.raises(ConfigError, match="speculative_algorithm eagle3 needs "):
        EngineConfig.from_flags(model="m", speculative_algorithm="eagle3")
    # random weights: an EAGLE-3 head without a path is a random head of the target's shape
    random_head = EngineConfig.from_flags(load_format="dummy", speculative_algorithm="eagle3")
    assert random_head.speculative.draft_model_path is None
    # auto is resolved from the model, on a section of the config's own
    given = SpeculativeConfig()
    assert given.algorithm == "auto" and given.policy is None  # pending until resolved
    config = EngineConfig(load=ModelLoadConfig(model="m"), speculative=given)
    assert config.speculative.algorithm is None and config.speculative.policy == "off"
    assert given.algorithm == "auto" and given.policy is None


@pytest.mark.parametrize(
    "flags, message",
    [
        (dict(speculative_draft_model_path="head"), "speculative_draft_model_path needs"),
        (dict(speculative_policy="fixed"), "speculative_policy needs"),
        (dict(speculative_simulate_acceptance=0.5), "speculative_simulate_acceptance needs"),
        (
            dict(speculative_algorithm="ngram", speculative_draft_model_path="head"),
            "speculative_draft_model_path is read by eagle3 and draft, not ngram",
        ),
        (dict(attention_backend="triton", device="cpu"), "attention_backend triton needs"),
        (
            dict(speculative_algorithm="ngram", speculative_head_parallel="sharded"),
            "speculative_head_parallel is read by eagle3 only, not ngram",
        ),
    ],
)
def test_options_that_would_do_nothing_are_refused(flags, message):
    """A drafter's options where the model leaves no drafter (another model than the
    embedded one, random weights) changed nothing and said nothing; so did a draft path
    under n-gram, and the Triton backend on the CPU failed once loaded."""
    with pytest.raises(ConfigError, match=message):
        EngineConfig.from_flags(model="m", **flags)
    with pytest.raises(ConfigError, match=message):
        EngineConfig.from_flags(model="llama-3.1-8b", load_format="dummy", **flags)
    plain = EngineConfig.from_flags(model="m", speculative_policy="off")  # (neutral: passes)
    assert plain.speculative.algorithm is None


def test_drafter_options_stay_with_speculation_turned_off_on_purpose():
    """speculative_algorithm none given with a drafter's options: switched off on purpose
    (a sweep's "off" server is its common flags, a drafter's included, and that one)."""
    off = EngineConfig.from_flags(
        model="m", speculative_algorithm="none", speculative_draft_model_path="head"
    )
    assert off.speculative.algorithm is None


WRONG_TYPES = [
    ("page_size", "16"),  # (a bare TypeError comparing it)
    ("page_size", None),
    ("page_size", 16.5),  # (failed deep in the engine)
    ("num_kv_pages", 10.7),
    ("speculative_num_steps", 2.5),
    ("max_num_seqs", 2.5),  # (these ran)
    ("max_num_batched_tokens", 7.5),
    ("tensor_parallel_size", True),
    ("seed", 1.5),
    ("disable_prefix_caching", "no"),
    ("disable_cuda_graph", 1),
    ("kv_cache_memory_fraction", "0.5"),
    ("kv_cache_memory_fraction", None),
    ("speculative_simulate_acceptance", True),
    ("model", 5),
    ("device", None),
    ("dist_init_addr", 29500),
]


@pytest.mark.parametrize("name, value", WRONG_TYPES)
def test_values_of_the_wrong_type_are_refused_by_name(name, value):
    """LLM's keywords come untyped: each is checked against its field's type (an int is no
    bool and a bool no int; a float takes an int; None only where the field allows it)."""
    with pytest.raises(ConfigError, match=f"^{name} must be .*; got {re.escape(repr(value))}$"):
        EngineConfig.from_flags(**{"model": "m", name: value})


def test_values_of_the_right_type_are_taken_as_pythons():
    import numpy as np

    config = EngineConfig.from_flags(
        model="m",
        page_size=np.int64(8),
        seed=np.int32(3),
        kv_cache_memory_fraction=1,
        num_kv_pages=None,
        speculative_simulate_acceptance=np.float32(0.5),
        speculative_algorithm="ngram",
    )
    assert (config.cache.page_size, config.load.seed) == (8, 3)
    assert type(config.cache.page_size) is int and type(config.load.seed) is int
    assert config.cache.memory_fraction == 1.0 and type(config.cache.memory_fraction) is float
    assert config.speculative.simulate_acceptance == 0.5
    assert type(config.speculative.simulate_acceptance) is float


def test_methods_across_sections():
    cpu = EngineConfig.from_flags(model="m", device="cpu")
    assert cpu.backend_name() == "torch" and not cpu.overlap_enabled()
    cuda = EngineConfig.from_flags(model="m", device="cuda")  # built without a GPU too
    assert cuda.backend_name() == "triton" and cuda.overlap_enabled()
    assert (
        EngineConfig.from_flags(model="m", device="cuda", attention_backend="torch").backend_name()
        == "torch"
    )


def test_a_schedule_alone_is_the_schedule_policy():
    """A table given without a policy was refused as 'got policy goodput' (a default the
    user never set): it is the schedule policy's."""
    spec = EngineConfig.from_flags(
        model="m", speculative_algorithm="ngram", speculative_schedule="1:2,16:0"
    ).speculative
    assert spec.policy == "schedule"
    with pytest.raises(ConfigError, match="head_parallel is read by eagle3 only, not draft"):
        EngineConfig.from_flags(
            model="m",
            speculative_algorithm="draft",
            speculative_draft_model_path="d",
            speculative_head_parallel="sharded",
        )


def test_eagle3_on_the_embedded_model_takes_its_shipped_head():
    """--speculative-algorithm eagle3 without a path on the embedded model was refused
    ('needs speculative_draft_model_path'), though its help says the shipped head is the
    default and the auto algorithm took it."""
    from specserve.core.config import shipped_head_path

    spec = EngineConfig.from_flags(speculative_algorithm="eagle3").speculative
    assert spec.draft_model_path == str(shipped_head_path())
    assert spec.draft_model_path == EngineConfig().speculative.draft_model_path
