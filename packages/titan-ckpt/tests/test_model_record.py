"""The model record: ``CheckpointManager(metadata=...)`` lands in every commit manifest, and
``titan-ckpt convert --to hf`` hands what a step records (model name, flavor, args), the
``--rope-scaling`` choice and the tensor shapes to the adapter factory, through the real
entry-point lookup. The factory here is installed for the test as a distribution of its own
(``test-record``); it writes what it was given into config.json, so the test reads exactly
what titan-ckpt passed: the recorded args, or the recorded flavor to a factory that takes no
args (``test-record-old``). Older factories (``test-llama``: flavor/hf_config only) keep working.
"""

from __future__ import annotations

import importlib
import json

import pytest
import torch

from titan_ckpt import CheckpointConfig, CheckpointManager
from titan_ckpt.layout import read_manifest
from titan_ckpt.storage import LocalStorage

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
pytest.importorskip("safetensors")

FACTORY = """
class Adapter:
    def __init__(self, given):
        self.given = given

    def to_hf(self, state_dict):
        return {"model." + k: v for k, v in state_dict.items()}

    def from_hf(self, hf_state_dict):
        return {k.removeprefix("model."): v for k, v in hf_state_dict.items()}

    def hf_config(self):
        return {"given": self.given}


def make(*, flavor=None, hf_config=None, model_args=None, overrides=None, tensor_shapes=None):
    if flavor is None and hf_config is None and model_args is None:
        raise ValueError("test-record needs a description")
    shapes = {k: list(v) for k, v in (tensor_shapes or {}).items()}
    return Adapter({"flavor": flavor, "model_args": model_args, "overrides": overrides,
                    "tensor_shapes": shapes})


def make_old(*, flavor=None, hf_config=None, overrides=None):
    return make(flavor=flavor, hf_config=hf_config, overrides=overrides)
"""

RECORD = {"name": "test-record", "flavor": "small", "args": {"width": 8, "rope_scaling": None}}


@pytest.fixture
def record_adapter(tmp_path_factory, monkeypatch):
    """The ``test-record`` adapter factory, installed as a distribution on sys.path."""
    site = tmp_path_factory.mktemp("site")
    (site / "titan_test_record.py").write_text(FACTORY)
    info = site / "titan_test_record-0.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: titan-test-record\nVersion: 0.0\n")
    (info / "entry_points.txt").write_text(
        "[titan.state_dict_adapters]\ntest-record = titan_test_record:make\n"
        "test-record-old = titan_test_record:make_old\n"
    )
    monkeypatch.syspath_prepend(str(site))
    importlib.invalidate_caches()
    return "test-record"


def save(folder, common, metadata=None):
    model = common.make_model(seed=0)
    manager = CheckpointManager(
        CheckpointConfig(enable=True, folder=str(folder), interval=1),
        model_parts=[model],
        metadata=metadata,
    )
    manager.save(1)
    manager.close()
    return model, folder / "step-1"


def test_metadata_lands_in_the_manifest_and_must_be_json(common, tmp_path):
    _, step = save(tmp_path / "ckpt", common, metadata={"model": RECORD})
    assert read_manifest(LocalStorage(), str(step)).metadata == {"model": RECORD}
    # ... and comes back with the step a manager loads.
    manager = CheckpointManager(
        CheckpointConfig(enable=True, folder=str(tmp_path / "ckpt")),
        model_parts=[common.make_model(seed=1)],
    )
    assert manager.loaded_metadata is None
    assert manager.load()
    assert manager.loaded_metadata == {"model": RECORD}
    manager.close()
    with pytest.raises(TypeError, match="JSON-serializable"):
        CheckpointManager(
            CheckpointConfig(enable=True, folder=str(tmp_path / "other")),
            model_parts=[common.make_model()],
            metadata={"dtype": torch.float32},
        )
    # A marker written before metadata existed still reads, with none.
    marker = step / "titan-commit.json"
    body = json.loads(marker.read_text())
    del body["metadata"]
    marker.write_text(json.dumps(body))
    assert read_manifest(LocalStorage(), str(step)).metadata == {}


def test_convert_hands_the_record_the_choice_and_the_shapes_to_the_adapter(
    common, record_adapter, tmp_path, titan_ckpt
):
    model, step = save(tmp_path / "ckpt", common, metadata={"model": RECORD})
    hf = tmp_path / "hf"
    code, _, err = titan_ckpt("convert", step, hf, "--to", "hf")  # model and args: recorded
    assert code == 0, err
    given = json.loads((hf / "config.json").read_text())["given"]
    assert given["model_args"] == RECORD["args"]
    # The recorded args are the model: the recorded flavor, whose sizes a run may have
    # changed ([model.args]), is no second description to contradict them.
    assert given["flavor"] is None
    assert given["overrides"] is None
    assert given["tensor_shapes"] == {k: list(v.shape) for k, v in model.state_dict().items()}
    assert "records no model args" not in err
    # --rope-scaling goes to the factory as an override (the adapter judges it).
    code, _, err = titan_ckpt("convert", step, tmp_path / "hf2", "--to", "hf",
                              "--rope-scaling", "none")  # fmt: skip
    assert code == 0, err
    given = json.loads((tmp_path / "hf2" / "config.json").read_text())["given"]
    assert given["overrides"] == {"rope_scaling": "none"}


def test_a_factory_without_model_args_gets_the_recorded_flavor(
    common, record_adapter, tmp_path, titan_ckpt
):
    record = {**RECORD, "name": "test-record-old"}
    _, step = save(tmp_path / "ckpt", common, metadata={"model": record})
    code, _, err = titan_ckpt("convert", step, tmp_path / "hf", "--to", "hf")
    assert code == 0, err
    given = json.loads((tmp_path / "hf" / "config.json").read_text())["given"]
    assert (given["flavor"], given["model_args"]) == ("small", None)


def test_without_a_record_the_description_must_be_given(
    common, record_adapter, tmp_path, titan_ckpt
):
    _, step = save(tmp_path / "ckpt", common)
    assert read_manifest(LocalStorage(), str(step)).metadata == {}
    cases = [
        (("--model", record_adapter), "records no model args to describe the model"),
        ((), "--to hf needs --model"),
    ]
    for flags, message in cases:
        code, _, err = titan_ckpt("convert", step, tmp_path / "o", "--to", "hf", *flags)
        assert code == 2, err
        assert message in err, err
    code, _, err = titan_ckpt("convert", step, tmp_path / "hf", "--to", "hf", "--model",
                              record_adapter, "--flavor", "small")  # fmt: skip
    assert code == 0, err
    given = json.loads((tmp_path / "hf" / "config.json").read_text())["given"]
    assert (given["flavor"], given["model_args"]) == ("small", None)
    assert not (tmp_path / "o").exists()


def test_rope_scaling_usage_errors(saved_folder, install_adapters, tmp_path, titan_ckpt):
    step = saved_folder / "step-2"
    config = tmp_path / "c.json"
    config.write_text(json.dumps({"hidden_size": 4}))
    cases = [
        (("--to", "dcp", "--rope-scaling", "none"), "--rope-scaling sets the RoPE"),
        (("--to", "hf", "--rope-scaling", "yarn"), "invalid choice: 'yarn'"),
        # An older factory (flavor/hf_config only) cannot take the override: said, not dropped.
        (("--to", "hf", "--model", "test-llama", "--hf-config", config, "--rope-scaling", "none"),
         "unexpected keyword argument 'overrides'"),
    ]  # fmt: skip
    for flags, message in cases:
        code, _, err = titan_ckpt("convert", step, tmp_path / "o", *flags)
        assert code == 2, (flags, err)
        assert message in err, (flags, err)
    assert not (tmp_path / "o").exists()
