"""zero_compile's options: ZeroConfig as config=, the renamed options (old names warn and
mean what they meant), the debugging group, and the two halves of the old ``prefetch``."""

import dataclasses
import warnings

import pytest
import torch

from support import models
from zero_fx import DebugOptions, ZeroConfig, rewritten_step_on_fake, zero_compile
from zero_fx.config import DEPRECATED_OPTIONS
from zero_fx.passes.common.predicates import is_all_gather, is_collective, is_wait

from test_api import batch, standard_step, tiny


@pytest.mark.parametrize("old, value, new", [
    ("memory_budget_bytes", 1 << 20, {"max_gathered_bytes": 1 << 20}),
    ("persistence_threshold", 7, {"resident_max_numel": 7}),
    ("activation_memory_budget", 0.25, {"activation_budget_fraction": 0.25}),
    ("activation_memory_budget", 1, {"activation_budget_fraction": 1}),
    ("activation_memory_budget", 5e6, {"activation_budget_bytes": 5_000_000}),
    ("prefetch", 2, {"prefetch_buckets": 2, "reduce_overlap_buckets": 2}),
    ("pin_schedule", False, {"debug": DebugOptions(pin_schedule=False)}),
    ("disable_passes", ["schedule_collectives"],
     {"debug": DebugOptions(disable_passes=("schedule_collectives",))}),
    ("dump_dir", "/tmp/dumps", {"debug": DebugOptions(dump_dir="/tmp/dumps")}),
    ("check_ranks", False, {"debug": DebugOptions(check_ranks=False)}),
])
@pytest.mark.parametrize("where", ["zero_compile", "ZeroConfig"])
def test_an_old_name_warns_with_the_new_one_and_means_the_same(where, old, value, new):
    wanted = ZeroConfig(**new)
    with pytest.warns(FutureWarning, match=rf"'{old}' is now .*{list(new)[0].split('_')[0]}") as seen:
        config = (zero_compile(standard_step, **{old: value}).config if where == "zero_compile"
                  else ZeroConfig(**{old: value}))
    assert config == wanted
    assert all(w.filename == __file__ for w in seen), "the warning points at the caller"
    with pytest.warns(FutureWarning, match=f"'{old}' is now"):
        getattr(config, old)  # reading it still works, and warns too


def test_every_old_name_is_covered():
    assert set(DEPRECATED_OPTIONS) == {
        "memory_budget_bytes", "persistence_threshold", "activation_memory_budget", "prefetch",
        "pin_schedule", "disable_passes", "dump_dir", "check_ranks"}


def test_an_old_name_with_its_new_name_is_an_error():
    with pytest.raises(ValueError, match="prefetch is the old name of prefetch_buckets"):
        with pytest.warns(FutureWarning):
            zero_compile(standard_step, prefetch=1, prefetch_buckets=2)
    with pytest.raises(ValueError, match="dump_dir is set both as a keyword and in debug="):
        with pytest.warns(FutureWarning):
            zero_compile(standard_step, dump_dir="a", debug=DebugOptions(dump_dir="b"))


def test_the_new_names_train_without_a_warning(tmp_path):
    """No internal reader uses a deprecated name: a step with every renamed option set by its
    new name runs without a FutureWarning."""
    model = tiny()
    opt = torch.optim.AdamW(model.parameters())
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        step = zero_compile(standard_step, backend="aot_eager", prefetch_buckets=2,
                            reduce_overlap_buckets=0, max_gathered_bytes=1 << 20,
                            resident_max_numel=0, activation_budget_fraction=0.5,
                            debug=DebugOptions(dump_dir=str(tmp_path), check_ranks=False,
                                               pin_schedule=False))
        step(model, opt, *batch())
        step.explain()
    assert any(tmp_path.rglob("*.txt"))


def test_config_is_accepted_and_keywords_fill_its_defaults():
    config = ZeroConfig(stage=2, bucket_bytes=0, debug=DebugOptions(check_ranks=False))
    step = zero_compile(standard_step, config=config, backend="eager",
                        debug=DebugOptions(disable_passes=["schedule_collectives"]))
    assert step.config == dataclasses.replace(
        config, backend="eager",
        debug=DebugOptions(check_ranks=False, disable_passes=("schedule_collectives",)))
    assert zero_compile(config=config)(standard_step).config is config
    assert zero_compile(standard_step, config=config, stage=2).config == config  # the same value
    model = tiny()
    step(model, torch.optim.AdamW(model.parameters()), *batch())
    assert step.plan.stage == 2


@pytest.mark.parametrize("config, options, message", [
    (ZeroConfig(stage=2), {"stage": 1}, r"stage is set both in config= \(2\) and as a keyword \(1\)"),
    (ZeroConfig(debug=DebugOptions(dump_dir="a")), {"debug": DebugOptions(dump_dir="b")},
     r"debug dump_dir is set both in config="),
])
def test_an_option_set_in_config_and_as_a_keyword_is_an_error(config, options, message):
    with pytest.raises(ValueError, match=message):
        zero_compile(standard_step, config=config, **options)


def test_config_must_be_a_zeroconfig_and_options_must_exist():
    with pytest.raises(TypeError, match="config must be a zero_fx.ZeroConfig"):
        zero_compile(standard_step, config={"stage": 2})
    with pytest.raises(TypeError, match="unknown option 'prefetch_bucket' .*did you mean 'prefetch_buckets'"):
        zero_compile(standard_step, prefetch_bucket=1)
    with pytest.raises(TypeError, match="debug must be a zero_fx.DebugOptions"):
        ZeroConfig(debug={"dump_dir": "x"})


@pytest.mark.parametrize("options, message", [
    ({"activation_budget_fraction": 2.0}, r"activation_budget_fraction must be a fraction in \(0, 1\].*activation_budget_bytes"),
    ({"activation_budget_bytes": 0.5}, r"activation_budget_bytes must be a number of bytes.*activation_budget_fraction"),
    ({"activation_budget_fraction": 0.5, "activation_budget_bytes": 10}, "not both"),
    ({"recompute": "blocks", "activation_budget_bytes": 10}, "goes with recompute='auto'"),
    ({"prefetch_buckets": -1}, "prefetch_buckets must be an int >= 0"),
    ({"reduce_overlap_buckets": 1.5}, "reduce_overlap_buckets must be an int >= 0"),
    ({"max_gathered_bytes": -1}, "max_gathered_bytes must be a number of bytes"),
    ({"resident_max_numel": -1}, "resident_max_numel must be an int >= 0"),
])
def test_bad_values_say_what_is_allowed(options, message):
    with pytest.raises(ValueError, match=message):
        ZeroConfig(**options)


def _waited_after(gm, kind):
    """For each collective of ``kind`` (all-gathers, or reductions), how many nodes after it its
    wait is: where the schedule put it."""
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    chosen = [n for n in gm.graph.nodes if is_collective(n) and (is_all_gather(n) == (kind == "gather"))]
    return [order[next(u for u in n.users if is_wait(u))] - order[n] for n in chosen]


def _scheduled(**options):
    gm, _ = rewritten_step_on_fake(lambda: models.build("gpt"), batch=2, seq=models.SEQ,
                                   vocab_size=models.VOCAB, world_size=2, stage=3,
                                   bucket_bytes=0, **options)
    return gm


def test_prefetch_buckets_and_reduce_overlap_buckets_move_only_their_own_collectives():
    neither = _scheduled(prefetch_buckets=0, reduce_overlap_buckets=0)
    gathers = _scheduled(prefetch_buckets=1, reduce_overlap_buckets=0)
    reductions = _scheduled(prefetch_buckets=0, reduce_overlap_buckets=1)
    assert _waited_after(gathers, "gather") != _waited_after(neither, "gather")
    assert _waited_after(gathers, "reduce") == _waited_after(neither, "reduce")
    assert _waited_after(reductions, "reduce") != _waited_after(neither, "reduce")
    assert _waited_after(reductions, "gather") == _waited_after(neither, "gather")
    with pytest.warns(FutureWarning):
        old = _scheduled(prefetch=1)  # both halves, as before
    both = _scheduled(prefetch_buckets=1, reduce_overlap_buckets=1)
    assert [n.target for n in old.graph.nodes] == [n.target for n in both.graph.nodes]


def test_zero_compile_lists_every_option_with_its_default():
    """The explicit signature stays in step with ZeroConfig: each plain field is a keyword with
    the field's default, each policy a keyword too, and each policy's flat options keywords
    with their field's defaults; the renamed names go to ``**deprecated``."""
    import inspect

    from zero_fx.config.policies import FLAT_FIELDS, FLAT_NAMES

    parameters = inspect.signature(zero_compile).parameters
    options = {name for name, p in parameters.items() if p.kind is p.KEYWORD_ONLY} - {
        "config", "model", "optimizer"}
    fields = {f.name: f for f in dataclasses.fields(ZeroConfig)}
    assert options == set(fields) | set(FLAT_FIELDS)
    default = ZeroConfig()
    for name in fields:
        if name not in FLAT_NAMES:
            assert parameters[name].default == getattr(default, name), name
    for flat, (keyword, field) in FLAT_FIELDS.items():
        assert parameters[flat].default == getattr(getattr(default, keyword), field), flat
    assert parameters["deprecated"].kind is inspect.Parameter.VAR_KEYWORD


def test_a_policy_given_whole_means_its_flat_options():
    from zero_fx import OffloadPolicy, QuantizationPolicy, RecomputePolicy, SchedulePolicy

    flat = ZeroConfig(bucket_bytes=0, prefetch_buckets=2, offload="optimizer", offload_step="overlap",
                      quantize_weights="int8", recompute="auto", activation_budget_fraction=0.5)
    grouped = ZeroConfig(schedule=SchedulePolicy(bucket_bytes=0, prefetch_buckets=2),
                         offload=OffloadPolicy(mode="optimizer", step="overlap"),
                         quantization=QuantizationPolicy(weights="int8"),
                         recompute=RecomputePolicy(mode="auto", budget_fraction=0.5))
    assert grouped == flat
    assert zero_compile(standard_step, schedule=SchedulePolicy(bucket_bytes=0, prefetch_buckets=2),
                        offload="optimizer", offload_step="overlap",
                        quantization=QuantizationPolicy(weights="int8"), recompute="auto",
                        activation_budget_fraction=0.5).config == flat
    assert flat.schedule == SchedulePolicy(bucket_bytes=0, prefetch_buckets=2)
    assert flat.offload == flat.offload_policy == OffloadPolicy(mode="optimizer", step="overlap")
    assert flat.quantization == QuantizationPolicy(weights="int8")
    assert flat.recompute == flat.recompute_policy == RecomputePolicy(mode="auto",
                                                                      budget_fraction=0.5)
    # a flat name reads its policy's field; replaced() changes one
    assert (flat.offload_step, flat.prefetch_buckets, flat.quantize_weights) == ("overlap", 2, "int8")
    assert flat.replaced(offload_step="sync", bucket_bytes=1).offload == OffloadPolicy(mode="optimizer")
    with pytest.raises(AttributeError, match="offload_stepp"):
        flat.offload_stepp
    with pytest.raises(ValueError, match="bucket_bytes is set both as a keyword and in schedule="):
        zero_compile(standard_step, schedule=SchedulePolicy(), bucket_bytes=0)
    with pytest.raises(ValueError, match="offload_step is set both"):
        ZeroConfig(offload=OffloadPolicy(mode="optimizer"), offload_step="overlap")
    with pytest.raises(TypeError, match="schedule must be a zero_fx.SchedulePolicy"):
        ZeroConfig(schedule={"bucket_bytes": 0})
    with pytest.raises(ValueError, match="prefetch_buckets must be an int >= 0"):
        ZeroConfig(schedule=SchedulePolicy(prefetch_buckets=-1))


def test_the_code_reads_options_from_their_policies():
    """Inside zero_fx the options are read where they are stored, ``config.offload.step``, not
    by the flat names users may write (``config.offload_step``), which only the door
    translates (issue 88: ``offload_step`` alone was read at 31 sites)."""
    import re
    from pathlib import Path

    import zero_fx
    from zero_fx.config.policies import FLAT_FIELDS

    flat = sorted(set(FLAT_FIELDS) - {"offload", "recompute"})  # those two name their policy
    read = re.compile(r"config\.(" + "|".join(flat) + r")\b")
    root = Path(zero_fx.__file__).parent
    found = [f"{path.relative_to(root)}:{number}: {line.strip()}"
             for path in sorted(root.rglob("*.py")) if path.parent.name != "config"
             for number, line in enumerate(path.read_text().splitlines(), 1)
             if read.search(line) and "``" not in line]
    assert not found, "\n".join(found)


def test_the_option_modules_old_paths_are_the_config_packages_modules():
    """zero_fx/config/ holds the options' modules (issue 88, the root): the old top-level
    paths give the same modules, and ``zero_fx.config`` what that module gave."""
    import importlib

    import zero_fx
    import zero_fx.config as config
    for old in ("policies", "checks", "renamed_options"):
        module = importlib.import_module(f"zero_fx.{old}")
        assert module is importlib.import_module(f"zero_fx.config.{old}")
        assert getattr(zero_fx, old) is module
    from zero_fx.policies import OffloadPolicy
    assert OffloadPolicy is zero_fx.OffloadPolicy
    assert config.ZeroConfig is zero_fx.ZeroConfig
    assert {"MixedPrecision", "DebugOptions", "describe_backend",
            "DEPRECATED_OPTIONS"} <= set(config.__all__)
