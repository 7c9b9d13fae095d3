from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from engine.config import ModelConfig
from engine.model.directory import load_arch, resolve_model_dir
from engine.model.loader import load_model, resolve_dtype, resolve_layer_kernels
from engine.model.tiny import TINY_MODEL_DIR
from tests.engine.model.checkpoints import make_hf_model, save_checkpoint

CPU = torch.device("cpu")


def _state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: tensor.clone() for name, tensor in model.state_dict().items()}


def test_sharded_checkpoint_loads_like_a_single_file(tmp_path: Path) -> None:
    hf_model = make_hf_model("qwen2")
    single = save_checkpoint(hf_model, tmp_path / "single")
    sharded = save_checkpoint(hf_model, tmp_path / "sharded", max_shard_size="40KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    assert len(list(sharded.glob("*.safetensors"))) > 1
    states = [_state(load_model(ModelConfig(model=str(path)), CPU, torch.float32, 64))
              for path in (single, sharded)]
    assert states[0].keys() == states[1].keys()
    assert all(torch.equal(states[0][name], states[1][name]) for name in states[0])


def test_fused_projections_hold_the_checkpoint_shards(tmp_path: Path) -> None:
    hf_model = make_hf_model("llama3")
    model = load_model(ModelConfig(model=str(save_checkpoint(hf_model, tmp_path))), CPU,
                       torch.float32, 64)
    attn = hf_model.model.layers[1].self_attn
    expected = torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight])
    assert torch.equal(model.model.layers[1].self_attn.qkv_proj.weight, expected)
    mlp = hf_model.model.layers[1].mlp
    assert torch.equal(model.model.layers[1].mlp.gate_up_proj.weight,
                       torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]))


def test_dummy_weights_are_reproducible_from_the_seed(tmp_path: Path) -> None:
    path = save_checkpoint(make_hf_model("qwen3"), tmp_path)
    (path / "model.safetensors").unlink()  # dummy loading needs only config.json

    def load(seed: int) -> dict[str, torch.Tensor]:
        config = ModelConfig(model=str(path), load_format="dummy", seed=seed)
        return _state(load_model(config, CPU, torch.float32, 64))

    first, again, other = load(1), load(1), load(2)
    assert all(torch.equal(first[name], again[name]) for name in first)
    assert not torch.equal(first["model.embed_tokens.weight"], other["model.embed_tokens.weight"])


def test_dtype_resolution() -> None:
    assert resolve_dtype("auto", CPU) is torch.float32
    assert resolve_dtype("auto", torch.device("cuda")) is torch.bfloat16
    assert resolve_dtype("bfloat16", CPU) is torch.bfloat16
    model = load_model(ModelConfig(model="tiny"), CPU, torch.bfloat16, 64)
    assert all(param.dtype is torch.bfloat16 for param in model.parameters())


def test_layer_kernels_resolution(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu = torch.device("cpu")
    assert resolve_layer_kernels("auto", cpu) == "torch"
    assert resolve_layer_kernels("torch", torch.device("cuda")) == "torch"
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert resolve_layer_kernels("triton", cpu) == "triton"
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        resolve_layer_kernels("triton", cpu)
    with pytest.raises(ValueError, match="layer_kernels"):
        ModelConfig(layer_kernels="cuda")  # type: ignore[arg-type]


def test_tiny_model_loads_with_tied_embeddings() -> None:
    assert resolve_model_dir("tiny") == TINY_MODEL_DIR
    model = load_model(ModelConfig(model="tiny"), CPU, torch.float32, 2048)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert load_arch("tiny").vocab_size == 272


def test_missing_directory_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="is not 'tiny', a catalogued model"):
        resolve_model_dir(str(tmp_path / "nowhere"))
    with pytest.raises(ValueError, match="is not 'tiny', a catalogued model"):
        resolve_model_dir("meta-llama/Llama-3.2-1B")


def test_checkpoint_without_weights_suggests_dummy(tmp_path: Path) -> None:
    path = save_checkpoint(make_hf_model("llama3"), tmp_path)
    (path / "model.safetensors").unlink()
    with pytest.raises(ValueError, match="--load-format dummy"):
        load_model(ModelConfig(model=str(path)), CPU, torch.float32, 64)


def test_bad_tensors_are_rejected(tmp_path: Path) -> None:
    path = save_checkpoint(make_hf_model("llama3"), tmp_path)
    config = ModelConfig(model=str(path))
    weights_path = path / "model.safetensors"
    from safetensors.torch import load_file

    weights = load_file(weights_path)
    save_file({**weights, "model.extra.weight": torch.zeros(2)}, weights_path)
    with pytest.raises(ValueError, match="matches no model parameter"):
        load_model(config, CPU, torch.float32, 64)
    bad_shape = {**weights, "model.norm.weight": torch.zeros(3)}
    save_file(bad_shape, weights_path)
    with pytest.raises(ValueError, match="has shape"):
        load_model(config, CPU, torch.float32, 64)
    missing = {name: t for name, t in weights.items() if "layers.1.self_attn.k_proj" not in name}
    save_file(missing, weights_path)
    with pytest.raises(ValueError, match="does not set"):
        load_model(config, CPU, torch.float32, 64)


def test_context_longer_than_the_model_supports_is_rejected(tmp_path: Path) -> None:
    path = save_checkpoint(make_hf_model("llama3"), tmp_path)
    assert json.loads((path / "config.json").read_text())["max_position_embeddings"] == 512
    with pytest.raises(ValueError, match="max_position_embeddings"):
        load_model(ModelConfig(model=str(path)), CPU, torch.float32, 1024)


def test_tiny_weights_are_the_pinned_ones() -> None:
    """Many tests' expected tokens follow from these weights: a change here changes them all."""
    state = load_model(ModelConfig(model="tiny"), CPU, torch.float32, 64).state_dict()
    embed = state["model.embed_tokens.weight"]
    assert embed[0, :3].tolist() == [
        -0.022516796365380287, -0.023047203198075294, -0.005011571571230888]
    assert state["model.layers.3.mlp.down_proj.weight"][-1, -1].item() == 0.020183686167001724
    total = sum(tensor.double().abs().sum().item() for name, tensor in state.items()
                if not name.startswith("lm_head"))  # tied to the embeddings
    assert total == pytest.approx(14258.69251932405, rel=1e-12)


def _dummy_checkpoint(tmp_path: Path) -> Path:
    path = save_checkpoint(make_hf_model("llama3"), tmp_path)
    (path / "model.safetensors").unlink()
    return path


def test_dummy_weights_round_one_float32_draw_to_every_dtype(tmp_path: Path) -> None:
    config = ModelConfig(model=str(_dummy_checkpoint(tmp_path)), load_format="dummy", seed=3)
    full = _state(load_model(config, CPU, torch.float32, 64))
    half = _state(load_model(config, CPU, torch.bfloat16, 64))
    assert all(torch.equal(half[name], full[name].to(torch.bfloat16)) for name in full)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_dummy_weights_are_drawn_on_the_device_and_tiny_on_the_cpu(tmp_path: Path) -> None:
    cuda = torch.device("cuda")
    config = ModelConfig(model=str(_dummy_checkpoint(tmp_path)), load_format="dummy", seed=3)
    model = load_model(config, cuda, torch.float32, 64)
    generator = torch.Generator(device=cuda).manual_seed(3)
    name, param = next((name, param) for name, param in model.named_parameters()
                       if not name.endswith(("norm.weight", ".bias")))
    expected = torch.randn(param.shape, generator=generator, device=cuda) * 0.02
    assert torch.equal(param, expected), name
    tiny_cpu = _state(load_model(ModelConfig(model="tiny"), CPU, torch.float32, 64))
    tiny_cuda = _state(load_model(ModelConfig(model="tiny"), cuda, torch.float32, 64))
    assert all(torch.equal(tiny_cuda[name].cpu(), tiny_cpu[name]) for name in tiny_cpu)
