"""The entry points this package registers load and build what they promise (needs the
package installed, e.g. editable, so that its metadata is visible)."""

from __future__ import annotations

from importlib.metadata import entry_points

import torch


def test_registered_entry_points_load():
    (adapter_ep,) = entry_points(group="titan.state_dict_adapters", name="llama3")
    adapter = adapter_ep.load()(flavor="debugmodel")
    assert adapter.hf_config()["num_hidden_layers"] == 6
    (model_ep,) = entry_points(group="titan.models", name="llama3")
    spec = model_ep.load()
    assert spec.name == "llama3"
    assert "405B" in spec.flavors
    with torch.device("meta"):
        model = spec.model_cls(spec.args_fn("debugmodel"))
    assert len(model.layers) == 6
