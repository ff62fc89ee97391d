"""Validation of the whole spec: CompileSpec, PipelineSpec, StageSpec, TraceSpec, InputSpec,
DataParallelSpec."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from qcompile.specs import (
    CompileSpec,
    DataParallelSpec,
    InputSpec,
    PipelineSpec,
    QuantSpec,
    StageSpec,
    TraceSpec,
)


def _locs(excinfo: pytest.ExceptionInfo[ValidationError]) -> list[tuple]:
    return [tuple(e["loc"]) for e in excinfo.value.errors()]


FULL = {
    "version": 1,
    "quant": {
        "mode": "qat",
        "rules": [
            {"match": {"name": "head"}, "skip": True},
            {
                "match": {"module": "Linear", "name": "encoder.*"},
                "weight": {"dtype": "int4", "symmetric": True, "granularity": "per_group",
                           "group_size": 32},
                "activation": {"dtype": "int8", "symmetric": False, "granularity": "per_token"},
            },
            {
                "match": {"module": ["Conv2d", "Linear"]},
                "weight": {"dtype": "int8", "granularity": "per_channel", "observer": "minmax"},
                "activation": {"dtype": "uint8", "symmetric": False,
                               "observer": {"kind": "moving_average", "momentum": 0.01}},
            },
            {"match": {"op": ["add", "matmul", "cat"]},
             "activation": {"dtype": "uint8", "symmetric": False}},
        ],
        "fold_bn": True,
        "sync_observers": True,
    },
    "data_parallel": {"kind": "ddp"},
    "pipeline": {"stages": 2, "devices": ["cpu", "cpu"], "balance": "params",
                 "microbatches": 4, "schedule": "gpipe"},
    "cache_dir": None,
    "trace": {"method": "symbolic", "leaf_modules": ["MyBlock"],
              "concrete_args": {"use_cache": False, "n": 3},
              "inputs": [{"shape": [2, 8]}, {"shape": [2], "dtype": "int64"}]},
}


# ---------------------------------------------------------------------------------------
# CompileSpec


def test_defaults() -> None:
    spec = CompileSpec()
    assert spec.version == 1
    assert spec.quant == QuantSpec()
    assert spec.quant.mode == "none"
    assert spec.data_parallel.kind == "none"
    assert spec.pipeline is None
    assert spec.cache_dir is None
    assert spec.trace == TraceSpec()
    assert CompileSpec.model_validate({}) == spec


def test_design_example_validates() -> None:
    spec = CompileSpec.model_validate(FULL)
    assert spec.quant.mode == "qat"
    assert len(spec.quant.rules) == 4
    assert spec.quant.rules[0].skip
    assert spec.quant.rules[1].match.module == ["Linear"]
    assert spec.quant.rules[1].match.name == ["encoder.*"]
    assert spec.quant.rules[1].weight.group_size == 32
    assert spec.quant.rules[2].activation.observer.kind == "moving_average"
    assert spec.data_parallel == DataParallelSpec(kind="ddp")
    assert spec.pipeline.num_stages == 2
    assert spec.pipeline.microbatches == 4
    assert spec.trace.inputs[1] == InputSpec(shape=[2], dtype="int64")


def test_model_dump_round_trip() -> None:
    spec = CompileSpec.model_validate(FULL)
    assert CompileSpec.model_validate(spec.model_dump()) == spec
    assert CompileSpec.model_validate(spec.model_dump(mode="json")) == spec
    assert CompileSpec.model_validate_json(spec.model_dump_json()) == spec


def test_inequality_is_detected() -> None:
    a = CompileSpec.model_validate(FULL)
    data = {**FULL, "pipeline": {**FULL["pipeline"], "microbatches": 8}}
    assert CompileSpec.model_validate(data) != a


@pytest.mark.parametrize("version", [0, 2, "2"])
def test_bad_version_rejected(version: object) -> None:
    with pytest.raises(ValidationError) as excinfo:
        CompileSpec.model_validate({"version": version})
    assert _locs(excinfo) == [("version",)]


@pytest.mark.parametrize(
    ("data", "loc"),
    [
        ({"quantization": {}}, ("quantization",)),
        ({"quant": {"mode": "qat", "rule": []}}, ("quant", "rule")),
        ({"quant": {"rules": [{"match": {"name": "x"}, "skip": True, "when": 1}]}},
         ("quant", "rules", 0, "when")),
        ({"quant": {"rules": [{"match": {"name": "x", "class": "Linear"}, "skip": True}]}},
         ("quant", "rules", 0, "match", "class")),
        ({"quant": {"rules": [{"match": {"name": "x"}, "weight": {"bits": 4}}]}},
         ("quant", "rules", 0, "weight", "bits")),
        ({"quant": {"inputs": {"dtype": "int8", "zero_point": 0}}}, ("quant", "inputs",
                                                                     "scheme", "zero_point")),
        ({"quant": {"rules": [{"match": {"name": "x"},
                               "activation": {"observer": {"kind": "moving_average",
                                                           "momentun": 0.1}}}]}},
         ("quant", "rules", 0, "activation", "observer", "moving_average", "momentun")),
        ({"pipeline": {"stages": 1, "chunks": 4}}, ("pipeline", "chunks")),
        ({"pipeline": {"stages": [{"modules": ["a"], "gpu": 0}]}},
         ("pipeline", "stages", "list[StageSpec]", 0, "gpu")),
        ({"data_parallel": {"kind": "ddp", "bucket_mb": 25}}, ("data_parallel", "bucket_mb")),
        ({"trace": {"tracer": "fx"}}, ("trace", "tracer")),
        ({"trace": {"inputs": [{"shape": [1], "device": "cpu"}]}},
         ("trace", "inputs", 0, "device")),
    ],
)
def test_unknown_keys_rejected_everywhere(data: dict, loc: tuple) -> None:
    with pytest.raises(ValidationError) as excinfo:
        CompileSpec.model_validate(data)
    errors = excinfo.value.errors()
    extra = [e for e in errors if e["type"] == "extra_forbidden"]
    assert [tuple(e["loc"]) for e in extra] == [loc]
    assert str(loc[-1]) in str(excinfo.value)


def test_frozen_top_level() -> None:
    spec = CompileSpec()
    with pytest.raises(ValidationError) as excinfo:
        spec.cache_dir = "/tmp/x"  # type: ignore[misc]
    assert excinfo.value.errors()[0]["type"] == "frozen_instance"
    assert spec.cache_dir is None


@pytest.mark.parametrize(
    ("path", "value"),
    [
        (("quant",), QuantSpec(mode="qat")),
        (("data_parallel", "kind"), "ddp"),
        (("pipeline", "microbatches"), 8),
        (("trace", "method"), "export"),
    ],
)
def test_frozen_nested(path: tuple[str, ...], value: object) -> None:
    spec = CompileSpec.model_validate(FULL)
    obj = spec
    for p in path[:-1]:
        obj = getattr(obj, p)
    before = getattr(obj, path[-1])
    with pytest.raises(ValidationError):
        setattr(obj, path[-1], value)
    assert getattr(obj, path[-1]) == before


def test_model_copy_update_leaves_original() -> None:
    spec = CompileSpec()
    other = spec.model_copy(update={"cache_dir": "/tmp/c"})
    assert other.cache_dir == "/tmp/c"
    assert spec.cache_dir is None


def test_cache_dir_kept() -> None:
    assert CompileSpec(cache_dir="/tmp/qc").cache_dir == "/tmp/qc"


# ---------------------------------------------------------------------------------------
# DataParallelSpec


@pytest.mark.parametrize("kind", ["none", "ddp", "fsdp2"])
def test_data_parallel_kinds(kind: str) -> None:
    assert DataParallelSpec(kind=kind).kind == kind


@pytest.mark.parametrize("kind", ["fsdp", "DDP", "deepspeed"])
def test_data_parallel_bad_kind(kind: str) -> None:
    with pytest.raises(ValidationError) as excinfo:
        CompileSpec.model_validate({"data_parallel": {"kind": kind}})
    assert _locs(excinfo) == [("data_parallel", "kind")]


# ---------------------------------------------------------------------------------------
# PipelineSpec


def test_pipeline_defaults() -> None:
    p = PipelineSpec()
    assert p.stages == 1
    assert p.num_stages == 1
    assert p.devices is None
    assert p.balance == "params"
    assert p.microbatches == 1
    assert p.schedule == "gpipe"
    assert p.transfer == "fp32"
    assert p.allow_tied is True


@pytest.mark.parametrize("stages", [1, 2, 7])
def test_pipeline_int_stages(stages: int) -> None:
    p = PipelineSpec(stages=stages, devices=["cpu"] * stages)
    assert p.num_stages == stages
    assert p.devices == ["cpu"] * stages


@pytest.mark.parametrize("stages", [0, -1])
def test_pipeline_stages_below_one_rejected(stages: int) -> None:
    with pytest.raises(ValidationError) as excinfo:
        PipelineSpec(stages=stages)
    assert "stages must be at least 1" in str(excinfo.value)
    assert _locs(excinfo)[0][0] == "stages"


def test_pipeline_empty_stage_list_rejected() -> None:
    with pytest.raises(ValidationError) as excinfo:
        PipelineSpec(stages=[])
    assert "at least one stage" in str(excinfo.value)


@pytest.mark.parametrize(("stages", "devices"), [(2, ["cpu"]), (1, ["cpu", "cpu"]),
                                                   (3, ["cuda:0", "cuda:1"])])
def test_pipeline_devices_length_mismatch(stages: int, devices: list[str]) -> None:
    with pytest.raises(ValidationError) as excinfo:
        PipelineSpec(stages=stages, devices=devices)
    msg = str(excinfo.value)
    assert f"devices lists {len(devices)} devices for {stages} stages" in msg
    assert "one device per stage" in msg


def test_pipeline_devices_length_mismatch_with_stage_list() -> None:
    stages = [{"modules": ["embed"]}, {"modules": ["layers.*"]}, {"modules": ["head"]}]
    with pytest.raises(ValidationError) as excinfo:
        PipelineSpec.model_validate({"stages": stages, "devices": ["cpu", "cpu"]})
    assert "devices lists 2 devices for 3 stages" in str(excinfo.value)


@pytest.mark.parametrize(
    "device", ["cpu", "cuda", "cuda:0", "cuda:1", "cuda:15", "mps", "xpu:2", "hpu", "npu:0"]
)
def test_pipeline_good_devices(device: str) -> None:
    assert PipelineSpec(stages=1, devices=[device]).devices == [device]


@pytest.mark.parametrize("device", ["gpu0", "gpu", "cuda0", "cuda:", "CPU", "cuda:-1",
                                    "cuda:a", " cpu", "tpu:0", ""])
def test_pipeline_bad_device_rejected(device: str) -> None:
    with pytest.raises(ValidationError) as excinfo:
        PipelineSpec(stages=2, devices=["cpu", device])
    msg = str(excinfo.value)
    assert repr(device) in msg
    assert "not a device string" in msg
    assert _locs(excinfo) == [("devices", 1)]  # the entry, by index


def test_pipeline_bad_device_path_in_compile_spec() -> None:
    with pytest.raises(ValidationError) as excinfo:
        CompileSpec.model_validate({"pipeline": {"stages": 1, "devices": ["gpu0"]}})
    assert _locs(excinfo) == [("pipeline", "devices", 0)]
    assert "'gpu0'" in str(excinfo.value)


@pytest.mark.parametrize("device", ["meta", "meta:0"])
def test_pipeline_meta_device_rejected(device: str) -> None:
    """``meta`` is a valid torch device but executes nothing: a stage there would run no
    computation at all."""
    with pytest.raises(ValidationError) as excinfo:
        CompileSpec.model_validate({"pipeline": {"stages": 2, "devices": ["cpu", device]}})
    assert _locs(excinfo) == [("pipeline", "devices", 1)]
    assert f"{device!r} holds no data" in str(excinfo.value)
    assert "'cpu', 'cuda'" in str(excinfo.value)
    with pytest.raises(ValidationError) as excinfo:
        PipelineSpec.model_validate({"stages": [{"modules": ["a"], "device": device}]})
    assert ("stages", "list[StageSpec]", 0, "device") in _locs(excinfo)


@pytest.mark.parametrize("value", ["", " ", "\t\n"])
def test_empty_cache_dir_rejected(value: str) -> None:
    """An empty cache_dir would be the current folder; null is how to say 'no cache'."""
    with pytest.raises(ValidationError) as excinfo:
        CompileSpec.model_validate({"cache_dir": value})
    assert _locs(excinfo) == [("cache_dir",)]
    assert "null (no cache) or a folder path" in str(excinfo.value)


def test_pipeline_stage_list() -> None:
    p = PipelineSpec.model_validate(
        {
            "stages": [
                {"modules": ["embed", "layers.0*"], "device": "cuda:0"},
                {"modules": ["layers.1*", "head"], "device": "cuda:1"},
                {"modules": ["norm"]},
            ]
        }
    )
    assert p.num_stages == 3
    assert isinstance(p.stages, list)
    assert p.stages[0] == StageSpec(modules=["embed", "layers.0*"], device="cuda:0")
    assert p.stages[1].device == "cuda:1"
    assert p.stages[2].device is None


def test_pipeline_stage_list_with_devices() -> None:
    p = PipelineSpec.model_validate(
        {"stages": [{"modules": ["a"]}, {"modules": ["b"]}], "devices": ["cpu", "cuda:1"]}
    )
    assert p.num_stages == 2
    assert p.devices == ["cpu", "cuda:1"]


def test_stage_bad_device_rejected() -> None:
    with pytest.raises(ValidationError) as excinfo:
        PipelineSpec.model_validate({"stages": [{"modules": ["a"], "device": "gpu0"}]})
    assert "'gpu0'" in str(excinfo.value)
    assert ("stages", "list[StageSpec]", 0, "device") in _locs(excinfo)


def test_stage_needs_modules() -> None:
    with pytest.raises(ValidationError) as excinfo:
        StageSpec(modules=[])
    assert _locs(excinfo) == [("modules",)]
    with pytest.raises(ValidationError) as excinfo:
        StageSpec.model_validate({"device": "cpu"})
    assert _locs(excinfo) == [("modules",)]


@pytest.mark.parametrize(
    ("field", "value"),
    [("balance", "memory"), ("schedule", "zero_bubble"), ("transfer", "int4"),
     ("microbatches", 0)],
)
def test_pipeline_bad_enum_fields(field: str, value: object) -> None:
    with pytest.raises(ValidationError) as excinfo:
        PipelineSpec.model_validate({field: value})
    assert _locs(excinfo) == [(field,)]


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved_1f1b"])
def test_pipeline_schedules(schedule: str) -> None:
    assert PipelineSpec(schedule=schedule).schedule == schedule


def test_pipeline_stages_not_a_string() -> None:
    with pytest.raises(ValidationError):
        PipelineSpec.model_validate({"stages": "two"})


# ---------------------------------------------------------------------------------------
# InputSpec and TraceSpec


def test_input_spec() -> None:
    i = InputSpec(shape=[2, 3, 224, 224])
    assert i.shape == [2, 3, 224, 224]
    assert i.dtype == "float32"
    assert InputSpec(shape=[]).shape == []  # a scalar
    assert InputSpec(shape=[0, 4]).shape == [0, 4]


def test_input_spec_negative_dim_rejected() -> None:
    with pytest.raises(ValidationError) as excinfo:
        InputSpec(shape=[2, -1, 4])
    msg = str(excinfo.value)
    assert "negative dimension" in msg
    assert "[2, -1, 4]" in msg
    assert _locs(excinfo) == [("shape",)]


def test_input_spec_negative_dim_path_in_compile_spec() -> None:
    with pytest.raises(ValidationError) as excinfo:
        CompileSpec.model_validate({"trace": {"inputs": [{"shape": [1]}, {"shape": [-3]}]}})
    assert _locs(excinfo) == [("trace", "inputs", 1, "shape")]


def test_input_spec_needs_shape() -> None:
    with pytest.raises(ValidationError) as excinfo:
        InputSpec.model_validate({"dtype": "float32"})
    assert _locs(excinfo) == [("shape",)]


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "int64", "bool", "uint8"])
def test_input_spec_dtypes(dtype: str) -> None:
    assert InputSpec(shape=[1], dtype=dtype).dtype == dtype


@pytest.mark.parametrize("dtype", ["float", "fp32", "int4", "torch.float32"])
def test_input_spec_bad_dtype(dtype: str) -> None:
    with pytest.raises(ValidationError) as excinfo:
        InputSpec(shape=[1], dtype=dtype)
    assert _locs(excinfo) == [("dtype",)]


def test_trace_defaults() -> None:
    t = TraceSpec()
    assert t.method == "auto"
    assert t.leaf_modules == []
    assert t.concrete_args == {}
    assert t.inputs is None


@pytest.mark.parametrize("method", ["auto", "symbolic", "export"])
def test_trace_methods(method: str) -> None:
    assert TraceSpec(method=method).method == method


def test_trace_bad_method() -> None:
    with pytest.raises(ValidationError) as excinfo:
        TraceSpec(method="jit")
    assert _locs(excinfo) == [("method",)]


def test_trace_concrete_args_keep_types() -> None:
    args = {"a": None, "b": True, "c": 3, "d": 0.5, "e": "mean"}
    t = TraceSpec(concrete_args=args)
    assert t.concrete_args == args
    assert t.concrete_args["b"] is True
    assert type(t.concrete_args["c"]) is int
    assert type(t.concrete_args["d"]) is float
    assert t.concrete_args["a"] is None
    round_tripped = TraceSpec.model_validate_json(t.model_dump_json())
    assert round_tripped == t
    assert round_tripped.concrete_args["b"] is True
    assert type(round_tripped.concrete_args["c"]) is int


@pytest.mark.parametrize("value", [[1, 2], {"x": 1}])
def test_trace_concrete_args_non_scalar_rejected(value: object) -> None:
    with pytest.raises(ValidationError) as excinfo:
        TraceSpec(concrete_args={"k": value})
    assert all(loc[:2] == ("concrete_args", "k") for loc in _locs(excinfo))


def test_trace_leaf_modules_and_inputs() -> None:
    t = TraceSpec.model_validate(
        {"leaf_modules": ["MyAttention", "encoder.layers.*"],
         "inputs": [{"shape": [4, 16]}, {"shape": [4], "dtype": "int64"}]}
    )
    assert t.leaf_modules == ["MyAttention", "encoder.layers.*"]
    assert [i.shape for i in t.inputs] == [[4, 16], [4]]


def test_pipeline_device_with_trailing_newline_rejected() -> None:
    with pytest.raises(ValidationError):
        PipelineSpec(stages=1, devices=["cpu\n"])
