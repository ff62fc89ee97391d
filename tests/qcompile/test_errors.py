"""Every mistake a user can make is a ``qc.QCompileError`` (or pydantic's
``ValidationError`` for specs) that names the spec field or graph node and says how to
fix it; never a bare traceback from deep inside torch (DESIGN.md, "Public API")."""

from __future__ import annotations

import socket
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import pydantic
import pytest
import torch
import torch.distributed as dist
from torch import nn

import qcompile as qc
import qcompile.distributed as qcd


def user_error(fn: Callable[[], object]) -> qc.QCompileError:
    """Run ``fn``, which must fail with a QCompileError carrying a fix."""
    try:
        fn()
    except Exception as e:  # any type: the isinstance below is the assertion
        assert isinstance(e, qc.QCompileError), f"{type(e).__name__}: {e}"
        assert isinstance(e.fix, str) and e.fix.strip(), f"no fix in {e}"
        assert e.message in str(e) and e.fix in str(e)
        return e
    raise AssertionError("no error raised")


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def qat(*rules: dict, **quant: object) -> dict:
    return {"quant": {"mode": "qat", "rules": list(rules), **quant}}


LINEAR_INT8 = {"match": {"module": "Linear"}, "weight": {"dtype": "int8"}}
X = torch.randn(2, 8)


# -- arguments ------------------------------------------------------------------------------
@pytest.mark.parametrize("model", [nn.Linear, lambda x: x, "model", None],
                         ids=["class", "function", "str", "None"])
def test_model_must_be_a_module_instance(model: object) -> None:
    e = user_error(lambda: qc.qcompile(model, "int8-qat"))
    assert "nn.Module" in e.message and "instance" in e.fix


@pytest.mark.parametrize("spec", [42, ["int8-qat"], object()], ids=["int", "list", "object"])
def test_spec_of_the_wrong_type(spec: object) -> None:
    e = user_error(lambda: qc.qcompile(mlp(), spec))
    assert "spec" in e.message and type(spec).__name__ in e.message
    assert "load_spec" in e.fix


def test_example_inputs_of_the_wrong_type() -> None:
    e = user_error(lambda: qc.qcompile(mlp(), "int8-qat", {"x": X}))
    assert "example_inputs" in e.message and "dict" in e.message


def test_too_many_example_inputs() -> None:
    e = user_error(lambda: qc.qcompile(mlp(), "int8-qat", (X, X)))
    assert "2 example inputs" in e.message and "takes 1" in e.message
    assert "one example value per model input" in e.fix


def test_example_kwargs_the_model_does_not_take() -> None:
    e = user_error(lambda: qc.qcompile(mlp(), "int8-qat", (X,), example_kwargs={"mask": X}))
    assert "mask" in e.message


def test_example_inputs_of_the_wrong_shape_name_the_node() -> None:
    e = user_error(lambda: qc.qcompile(mlp(), "int8-qat", (torch.randn(2, 5),)))
    assert "node 'linear'" in e.message or "node '_0'" in e.message, e.message
    assert "example_inputs" in e.fix


# -- spec files -------------------------------------------------------------------------
def test_missing_spec_file(tmp_path: Path) -> None:
    missing = tmp_path / "nope.yaml"
    for call in (lambda: qc.load_spec(missing), lambda: qc.qcompile(mlp(), missing),
                 lambda: qc.qcompile(mlp(), str(missing))):
        e = user_error(call)
        assert str(missing) in e.message and "does not exist" in e.message
        assert "int8-qat" in e.fix  # lists the presets


def test_unparsable_and_non_mapping_spec_files(tmp_path: Path) -> None:
    broken = tmp_path / "broken.yaml"
    broken.write_text("quant: {mode: qat\n")
    e = user_error(lambda: qc.qcompile(mlp(), broken))
    assert "broken.yaml" in e.message and "not valid yaml" in e.message.lower()
    assert "line 2" in e.message  # the position of the syntax error
    listing = tmp_path / "list.json"
    listing.write_text("[1, 2]")
    e = user_error(lambda: qc.qcompile(mlp(), listing))
    assert "mapping" in e.message and "list" in e.message


@pytest.mark.parametrize(("spec", "loc"), [
    ({"quant": {"mode": "qat", "bogus": 1}}, ("quant", "bogus")),
    (qat({"match": {"module": "Linear"}, "weight": {"dtype": "int33"}}),
     ("quant", "rules", 0, "weight", "dtype")),
    (qat({"match": {"module": "Linear"}, "weight": {"dtype": "int4",
                                                    "granularity": "per_group"}}),
     ("quant", "rules", 0, "weight")),
    ({"quant": {"mode": "sometimes"}}, ("quant", "mode")),
])
def test_invalid_spec_is_a_validation_error_naming_the_field(spec: dict, loc: tuple) -> None:
    with pytest.raises(pydantic.ValidationError) as ei:
        qc.qcompile(mlp(), spec)
    assert any(err["loc"] == loc for err in ei.value.errors()), ei.value.errors()


# -- tracing ------------------------------------------------------------------------------
class Gate(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:  # data-dependent control flow: symbolic tracing cannot follow it
            return x
        return -x


class Gated(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.gate = Gate()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.gate(self.fc(x))


def test_untraceable_submodule_is_named_with_the_leaf_modules_fix() -> None:
    e = user_error(lambda: qc.qcompile(Gated(), "int8-qat", (X,)))
    assert "'gate'" in e.message and "Gate" in e.message
    assert "trace.leaf_modules" in e.fix and "Gate" in e.fix
    assert isinstance(e.__cause__, Exception)  # the torch error is kept as the cause
    # ... and the fix works.
    spec = {**qc.load_spec("int8-qat").model_dump(mode="json"),
            "trace": {"leaf_modules": ["Gate"]}}
    gm = qc.qcompile(Gated(), spec, (X,))
    assert "fc.weight_fake_quant" in qc.quantizers(gm)
    assert gm(X).shape == (2, 8)


def test_export_front_end_without_inputs() -> None:
    e = user_error(lambda: qc.qcompile(mlp(), {"trace": {"method": "export"}}))
    assert "needs example inputs" in e.message and "trace.inputs" in e.fix


# -- rules ----------------------------------------------------------------------------------
def test_rule_matching_nothing_names_the_rule() -> None:
    conv = {"match": {"module": "Conv2d"}, "weight": {"dtype": "int8"}}
    e = user_error(lambda: qc.qcompile(mlp(), qat(LINEAR_INT8, conv), (X,)))
    assert "quant.rules[1]" in e.message and "Conv2d" in e.message
    assert "Linear" in e.message  # says what the graph does contain
    assert "optional" in e.fix
    gm = qc.qcompile(mlp(), qat(LINEAR_INT8, {**conv, "optional": True}), (X,))
    assert qc.quantizers(gm)


def test_rule_shadowed_by_an_earlier_rule_names_it() -> None:
    shadowed = {"match": {"name": "0"}, "weight": {"dtype": "int4"}}
    e = user_error(lambda: qc.qcompile(mlp(), qat(LINEAR_INT8, shadowed), (X,)))
    assert "quant.rules[1]" in e.message and "earlier" in e.message


def test_group_size_not_dividing_names_the_parameter() -> None:
    rule = {"match": {"module": "Linear"},
            "weight": {"dtype": "int4", "granularity": "per_group", "group_size": 3}}
    e = user_error(lambda: qc.qcompile(mlp(), qat(rule), (X,)))
    assert "'0.weight'" in e.message
    assert "group_size" in e.message and "quant.rules[0].weight" in e.message
    assert "quant.rules[0].weight" in e.fix


def test_w4a8_preset_on_a_too_narrow_linear() -> None:
    e = user_error(lambda: qc.qcompile(mlp(), "w4a8-qat", (X,)))
    assert "'0.weight'" in e.message and "group_size 32" in e.message


def test_channel_axis_out_of_range_names_the_parameter() -> None:
    rule = {"match": {"module": "Linear"},
            "weight": {"dtype": "int8", "granularity": "per_channel", "axis": 5}}
    e = user_error(lambda: qc.qcompile(mlp(), qat(rule), (X,)))
    assert "'0.weight'" in e.message and "axis 5" in e.message


def test_per_channel_activation_without_inputs_asks_for_them() -> None:
    rule = {"match": {"module": "Linear"},
            "activation": {"dtype": "int8", "granularity": "per_channel"}}
    e = user_error(lambda: qc.qcompile(mlp(), qat(rule)))
    assert "quant.rules[0].activation" in e.message and "example_inputs" in e.message
    gm = qc.qcompile(mlp(), qat(rule), (X,))  # with inputs it compiles
    assert qc.quantizers(gm)["0.output_fake_quant"].scale.numel() == 16


# -- features of later versions -----------------------------------------------------------
def test_pipeline_stages_beyond_cuttable_positions() -> None:
    e = user_error(lambda: qc.qcompile(mlp(), {"pipeline": {"stages": 50}}, (X,)))
    assert "pipeline.stages: 50 stages need 49 cuts" in e.message
    assert "use at most" in e.fix
    gm = qc.qcompile(mlp(), {"pipeline": {"stages": 1}}, (X,))  # one stage is fine
    assert torch.equal(gm(X), mlp()(X))
    assert [name for name, _ in gm.named_children()] == ["stage_0"]


def test_pipeline_device_that_does_not_exist() -> None:
    spec = {"pipeline": {"stages": 2, "devices": ["cpu", "cuda:7"]}}
    e = user_error(lambda: qc.qcompile(mlp(), spec, (X,)))
    assert "pipeline.devices[1]" in e.message and "cuda:7" in e.message


@pytest.mark.parametrize("kind", ["histogram", "percentile", "mse"])
def test_histogram_family_observers_are_per_tensor_only(kind: str) -> None:
    rule = {"match": {"module": "Linear"},
            "weight": {"dtype": "int8", "granularity": "per_channel", "observer": kind}}
    e = user_error(lambda: qc.qcompile(mlp(), qat(rule), (X,)))
    assert "quant.rules[0].weight.observer" in e.message and "per_tensor only" in e.message
    assert "minmax" in e.fix
    ok = {"match": {"module": "Linear"}, "activation": {"dtype": "uint8", "symmetric": False,
                                                        "observer": kind}}
    gm = qc.qcompile(mlp(), qat(ok), (X,))  # per-tensor: available
    gm(X)


# -- calibration ----------------------------------------------------------------------------
def test_calibrate_without_quantizers_or_batches() -> None:
    plain = qc.qcompile(mlp(), {"quant": {"mode": "none"}}, (X,))
    e = user_error(lambda: qc.calibrate(plain, [(X,)]))
    assert "no quantizers" in e.message and "static" in e.fix
    static = qc.qcompile(mlp(), "int8-static", (X,))
    e = user_error(lambda: qc.calibrate(static, []))
    assert "no batches" in e.message


def test_calibrate_with_nan_names_the_batch() -> None:
    static = qc.qcompile(mlp(), "int8-static", (X,))
    bad = X.clone()
    bad[1, 3] = float("nan")
    e = user_error(lambda: qc.calibrate(static, [(X,), (bad,)]))
    assert "batch 1" in e.message and "NaN" in e.fix


def test_calibrate_with_inf_is_an_error() -> None:
    # A single Linear: the Inf reaches the output observer as +-inf (no NaN on the way).
    torch.manual_seed(0)
    static = qc.qcompile(nn.Sequential(nn.Linear(8, 4)), "int8-static", (X,))
    bad = X.clone()
    bad[0, 0] = float("inf")
    e = user_error(lambda: qc.calibrate(static, [(X,), (bad,)]))
    assert "batch 1" in e.message and "Inf" in e.fix


# -- data-parallel wrappers: compile first, then wrap ----------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def gloo() -> Iterator[None]:
    """A one-rank gloo process group for the duration of this module's DDP/FSDP tests."""
    if not dist.is_available():
        pytest.skip("torch.distributed is not available")
    assert not dist.is_initialized()
    dist.init_process_group("gloo", rank=0, world_size=1,
                            init_method=f"tcp://127.0.0.1:{_free_port()}")
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_ddp_wrapped_model_is_refused(gloo: None) -> None:
    ddp = nn.parallel.DistributedDataParallel(mlp())
    e = user_error(lambda: qc.qcompile(ddp, "int8-qat", (X,)))
    assert "DistributedDataParallel" in e.message and "before" in e.message
    assert ".module" in e.fix and "wrap" in e.fix
    # The fix works: compile the bare module, then wrap the result.
    gm = qc.qcompile(ddp.module, "int8-qat", (X,))
    wrapped = nn.parallel.DistributedDataParallel(gm)
    wrapped(X).sum().backward()
    assert gm.get_submodule("0").weight.grad is not None


def test_model_containing_a_ddp_submodule_is_refused(gloo: None) -> None:
    outer = nn.Sequential(nn.parallel.DistributedDataParallel(mlp()), nn.ReLU())
    e = user_error(lambda: qc.qcompile(outer, "int8-qat", (X,)))
    assert "DistributedDataParallel" in e.message


def test_fully_shard_model_is_refused(gloo: None) -> None:
    # fully_shard (FSDP2) works on CPU with a gloo group, so the real wrapper is tested.
    from torch.distributed.fsdp import fully_shard

    model = mlp()
    fully_shard(model)
    assert qcd.wrapper_kind(model) == "fully_shard"
    e = user_error(lambda: qc.qcompile(model, "int8-qat", (X,)))
    assert "fully_shard" in e.message and "before" in e.message
    assert "fully_shard" in e.fix and "fsdp2" in e.fix


def test_fsdp1_model_is_refused(gloo: None) -> None:
    from torch.distributed.fsdp import FullyShardedDataParallel

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # FSDP1 is deprecated
        wrapped = FullyShardedDataParallel(mlp(), device_id=torch.device("cpu"))
    e = user_error(lambda: qc.qcompile(wrapped, "int8-qat", (X,)))
    assert "FullyShardedDataParallel" in e.message and "FSDP2" in e.fix


def test_data_parallel_model_is_refused_with_the_ddp_recipe() -> None:
    e = user_error(lambda: qc.qcompile(nn.DataParallel(mlp()), "int8-qat", (X,)))
    assert "DataParallel" in e.message and "replicas" in e.message
    assert "qc.distributed.wrap(gm, spec)" in e.fix and "torchrun" in e.fix


def test_ddp_refusal_points_to_wrap_not_a_hand_written_ddp(gloo: None) -> None:
    e = user_error(lambda: qc.qcompile(nn.parallel.DistributedDataParallel(mlp()),
                                       "int8-qat", (X,)))
    assert "qc.distributed.wrap(gm, spec)" in e.fix and "sync_observers" in e.fix


def test_compiled_submodule_is_refused() -> None:
    model = mlp()
    model[0] = torch.compile(model[0])
    e = user_error(lambda: qc.qcompile(model, "int8-qat", (X,)))
    assert "'0'" in e.message and "0._orig_mod" in e.fix


def test_unwrapped_model_passes_the_guard() -> None:
    assert qcd.wrapper_kind(mlp()) is None
    qcd.refuse_wrapped(mlp())  # no error
