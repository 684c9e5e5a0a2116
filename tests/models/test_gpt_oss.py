"""GPT-OSS against transformers' GptOssForCausalLM (fp32, CPU, eager attention: transformers
has no SDPA one for it), and through the product."""

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from family_checks import check_emulated_lr0, check_hf_checkpoint, check_init_checkpoint
from cli_util import run_cli
from moegraph_cli import models
from moegraph_cli.io.checkpoint_save import save_checkpoint
from moegraph_cli.io.hf_names import hf_to_moegraph_names, to_moegraph_layout
from moegraph_cli.io.documents import show
from moegraph_cli.commands.reference_check import honour_config
from moegraph_cli.errors import UsageError

transformers = pytest.importorskip("transformers")

YARN = {"rope_type": "yarn", "rope_theta": 5000.0, "factor": 8.0,
        "original_max_position_embeddings": 32, "beta_fast": 16.0, "beta_slow": 2.0,
        "truncate": False}


def hf_config(**overrides):
    # swiglu_limit small enough that the clamps act on these weights (checked below).
    fields = dict(vocab_size=96, hidden_size=32, intermediate_size=24, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=12,
                  num_local_experts=6, num_experts_per_tok=3, rms_norm_eps=1e-6,
                  rope_parameters=YARN, sliding_window=16, max_position_embeddings=256,
                  layer_types=["full_attention", "sliding_attention", "sliding_attention"],
                  router_aux_loss_coef=0.05, swiglu_limit=0.3, swiglu_alpha=1.5,
                  attn_implementation="eager")
    fields.update(overrides)
    cfg = transformers.GptOssConfig(**fields)
    cfg.architectures = ["GptOssForCausalLM"]
    return cfg


@pytest.mark.parametrize("overrides", [{}, {"tie_word_embeddings": True,
                                            "rope_parameters": {"rope_type": "default",
                                                                "rope_theta": 7000.0}}])
def test_transformers_checkpoint_loads_and_matches(tmp_path, overrides):
    ours = check_hf_checkpoint(tmp_path, hf_config(**overrides), attn="eager")
    cfg = ours.config
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (6, 3, 24)
    assert cfg.layer_types == ["full_attention", "sliding_attention", "sliding_attention"]
    assert [layer.attn.sliding_window for layer in ours.layers] == [None, 16, 16]
    assert (cfg.swiglu_limit, cfg.swiglu_alpha, cfg.rms_norm_eps) == (0.3, 1.5, 1e-6)
    assert cfg.rope_scaling == (None if overrides else {k: v for k, v in YARN.items()
                                                        if k != "rope_theta"})
    # The clamps act: some expert pre-activations lie beyond the limit.
    x = torch.randn(64, 32, generator=torch.Generator().manual_seed(0))
    y1 = torch.einsum("th,efh->tef", x, ours.layers[0].moe.w_gate_up)
    assert (y1.abs() > 0.3).float().mean() > 0.05


def _grads_by_hf_name(model, table):
    named = dict(model.named_parameters())
    return {hf: named[slot.name] for hf, slot in table.items()}


def test_gradients_match_transformers_sinks_and_biases_included(tmp_path):
    cfg = hf_config()
    torch.manual_seed(0)
    theirs = transformers.GptOssForCausalLM(cfg).float()
    with torch.no_grad():
        for p in theirs.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    theirs.save_pretrained(tmp_path / "hf")
    ours = models.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    honour_config(theirs)  # where transformers ignores the swiglu fields (5.17)
    ids = torch.randint(0, 96, (2, 40), generator=torch.Generator().manual_seed(3))
    a = ours(ids, labels=ids)
    b = theirs(ids, labels=ids, output_router_logits=True)
    assert abs(a.loss.item() - b.loss.item()) <= 1e-4
    a.loss.backward()
    b.loss.backward()
    table = hf_to_moegraph_names(ours.config, range(3))
    hf_params = dict(theirs.named_parameters())
    mine = dict(ours.named_parameters())
    checked = set()
    for hf_name, slot in table.items():
        g_hf = to_moegraph_layout(hf_params[hf_name].grad, slot.layout)
        g_ours = mine[slot.name].grad[slot.index]
        scale = g_hf.abs().max().item()
        assert scale > 0, hf_name
        assert (g_ours - g_hf).abs().max().item() <= 1e-4 * max(1.0, scale), hf_name
        checked.add(hf_name.rsplit(".", 1)[-1] if "experts" in hf_name or "sinks" in hf_name
                    else hf_name.split(".")[-2] + "." + hf_name.split(".")[-1])
    assert {"sinks", "gate_up_proj_bias", "down_proj_bias", "router.bias", "q_proj.bias",
            "o_proj.bias"} <= checked


@pytest.mark.parametrize("overrides", [[], ["model.tie_word_embeddings=true",
                                            "model.sliding_window=6"]])
def test_init_checkpoint_loads_in_transformers(tmp_path, overrides):
    ours, theirs = check_init_checkpoint(tmp_path, "tiny-gpt-oss",
                                         ["model.sliding_window=8", *overrides], attn="eager")
    written = json.loads((tmp_path / "init" / "config.json").read_text())
    assert written["model_type"] == "gpt_oss" and written["num_local_experts"] == 8
    assert written["intermediate_size"] == 16  # the expert width, in transformers' spelling
    assert "quantization_config" not in written
    assert theirs.config.layer_types == ["sliding_attention", "full_attention",
                                         "sliding_attention"]
    assert theirs.config.sliding_window == ours.config.sliding_window
    assert theirs.config.rope_parameters["rope_type"] == "yarn"


@pytest.mark.parametrize("extra", [["model.sliding_window=4"],
                                   ["moe.mode=capacity", "moe.capacity_factor=0.5"]])
def test_graphs_lr0_bitwise(extra):
    check_emulated_lr0("tiny-gpt-oss", extra)


# -- MXFP4 -------------------------------------------------------------------------------

FP4 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                    -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def quantize_mxfp4(w_EAB: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A plain quantiser: (blocks [E, B, A/32, 16], scales [E, B, A/32]) of HF tensor w."""
    g = w_EAB.float().transpose(1, 2).unflatten(-1, (-1, 32))  # [E, B, G, 32]
    amax = g.abs().amax(-1, keepdim=True).clamp_min(1e-30)
    exp = torch.ceil(torch.log2(amax / 6.0)).clamp(-127, 127)
    codes = (g / torch.exp2(exp))[..., None].sub(FP4).abs().argmin(-1).to(torch.uint8)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return blocks, (exp[..., 0] + 127).to(torch.uint8)


def _mxfp4_checkpoint(tmp_path):
    cfg = hf_config(hidden_size=64, intermediate_size=32, swiglu_limit=7.0)
    torch.manual_seed(0)
    theirs = transformers.GptOssForCausalLM(cfg).float()
    with torch.no_grad():
        for p in theirs.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    src = tmp_path / "plain"
    theirs.save_pretrained(src)
    with safe_open(src / "model.safetensors", framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    packed = {}
    for k, t in tensors.items():
        if k.endswith(("experts.gate_up_proj", "experts.down_proj")):
            packed[k + "_blocks"], packed[k + "_scales"] = quantize_mxfp4(t)
        else:
            packed[k] = t
    out = tmp_path / "mxfp4"
    out.mkdir()
    save_file(packed, out / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens",
        "lm_head"]}
    (out / "config.json").write_text(json.dumps(config))
    return out, tensors, packed


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mxfp4_checkpoint_loads_dequantised_as_transformers(tmp_path, dtype):
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    path, plain, packed = _mxfp4_checkpoint(tmp_path)
    ours = models.from_pretrained(path, dtype=dtype)
    table = hf_to_moegraph_names(ours.config, range(3))
    state = ours.state_dict()
    for i in range(3):
        for proj in ("gate_up_proj", "down_proj"):
            key = f"model.layers.{i}.mlp.experts.{proj}"
            ref = convert_moe_packed_tensors(packed[key + "_blocks"], packed[key + "_scales"],
                                             dtype=dtype)
            assert ref.shape == plain[key].shape
            # quantised, not garbage: within FP4's rounding of the original weights
            assert (ref.float() - plain[key]).abs().max() <= plain[key].abs().max() / 4
            got = state[table[key].name]
            assert got.dtype == dtype
            assert torch.equal(got, to_moegraph_layout(ref, table[key].layout)), key
    # Unquantised tensors load as they are; saving writes no blocks, and reloads the same.
    assert torch.equal(state["layers.0.attn.sinks"],
                       plain["model.layers.0.self_attn.sinks"].to(dtype))
    save_checkpoint(state, ours.config, tmp_path / "saved")
    saved_cfg = json.loads((tmp_path / "saved" / "config.json").read_text())
    assert "quantization_config" not in saved_cfg
    with safe_open(tmp_path / "saved" / "model.safetensors", framework="pt") as f:
        assert not [k for k in f.keys() if k.endswith(("_blocks", "_scales"))]
    again = models.from_pretrained(tmp_path / "saved", dtype=dtype)
    for k, t in again.state_dict().items():
        assert torch.equal(t, state[k]), k


@pytest.mark.parametrize("method", ["fp8", "bitsandbytes_4bit", None])
def test_other_quantisation_fails_with_one_clear_sentence(tmp_path, method):
    path, _, _ = _mxfp4_checkpoint(tmp_path)
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"]["quant_method"] = method
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UsageError) as e:
        models.from_pretrained(path, dtype=torch.float32)
    assert str(e.value) == (f"{path / 'config.json'}: quantization_config.quant_method "
                            f"{show(method)} is not supported for gpt_oss checkpoints "
                            "(moegraph reads unquantised and mxfp4 weights)")
    code, _, err = run_cli("inspect", "--checkpoint", path)
    assert code == 2 and "is not supported for gpt_oss checkpoints" in err
    assert "Traceback" not in err


# -- configs and profiles -----------------------------------------------------------------

def test_published_config_spellings_read_as_the_profile():
    """gpt-oss-20b's config.json as the hub has it (transformers 4.x: rope_scaling and
    rope_theta, experts_per_token, mxfp4) and transformers 5.x's GptOssConfig (rope_parameters,
    its defaults: the 120b) read as the profiles."""
    from moegraph_cli.config import ModelConfig, load_profile

    p20 = load_profile("gpt-oss-20b").model
    hub = {k: v for k, v in p20.to_hf_dict().items() if k != "rope_parameters"}
    hub.pop("num_experts_per_tok")
    hub.update(experts_per_token=4, initial_context_length=4096, rope_theta=150000,
               quantization_config={"quant_method": "mxfp4"})
    assert ModelConfig.from_hf_dict(hub) == p20
    v5 = transformers.GptOssConfig(router_aux_loss_coef=0.9).to_dict()
    assert ModelConfig.from_hf_dict(v5) == load_profile("gpt-oss-120b").model


@pytest.mark.parametrize("profile,budget,params", [
    ("gpt-oss-20b", "200GiB", 20.91e9), ("gpt-oss-120b", "1TiB", 116.83e9),
    ("gpt-oss-20b-4layer", "139GiB", None)])
def test_published_profiles_inspect_and_plan_on_the_cpu(profile, budget, params):
    code, out, err = run_cli("inspect", "--profile", profile, "--json")
    assert code == 0, err
    total = json.loads(out)["params"]["total"]
    if params is not None:
        assert abs(total - params) / params < 1e-3, total
    code, out, err = run_cli("plan", "--profile", profile, "--budget", budget, "--json")
    assert code == 0, err
    plan = json.loads(out)
    assert 0 < plan["required_budget"] <= plan["budget"]


def test_inspect_shapes_and_refusals():
    code, out, err = run_cli("inspect", "--profile", "tiny-gpt-oss", "--json")
    assert code == 0, err
    shapes = json.loads(out)["layer_groups"][0]["shapes"]
    assert shapes["attn.sinks"] == [8] and shapes["attn.q_proj.bias"] == [512]
    assert shapes["moe.router.bias"] == [8] and shapes["moe.b_gate_up"] == [8, 512]
    assert shapes["moe.w_gate_up"] == [8, 512, 512] and shapes["moe.b_down"] == [8, 512]
    code, out, err = run_cli("inspect", "--profile", "tiny-gpt-oss", "--set",
                             "model.layer_types=[full_attention]")
    assert code == 2 and "layer_types must" in err
    code, out, err = run_cli("inspect", "--profile", "tiny-mixtral", "--set",
                             "model.swiglu_limit=7.0")
    assert code == 2 and "swiglu_limit is not a mixtral setting" in err


def test_local_loader_reads_layouts_and_mxfp4_as_the_full_loader(tmp_path):
    """checkpoint_local (the sharded loader) de-interleaves, transposes and dequantises the
    same way, also for a slice of the experts (expert parallelism)."""
    from moegraph_cli.io.checkpoint_local import load_local_

    path, _, _ = _mxfp4_checkpoint(tmp_path)
    full = models.from_pretrained(path, dtype=torch.float32)
    model = models.MoeCausalLM(full.config).float()
    load_local_(model, path, full.config)
    for k, t in full.state_dict().items():
        assert torch.equal(model.state_dict()[k], t), k
    lo, hi = 2, 4
    local = models.MoeCausalLM(full.config).float()
    for layer in local.layers:  # this rank's experts only, as an EP rank builds them
        m = layer.moe
        for name in ("w_gate_up", "w_down", "b_gate_up", "b_down"):
            setattr(m, name, torch.nn.Parameter(getattr(m, name)[lo:hi].clone()))
    load_local_(local, path, full.config, expert_range=(lo, hi))
    for name, t in local.state_dict().items():
        ref = full.state_dict()[name]
        if name.endswith(("w_gate_up", "w_down", "b_gate_up", "b_down")):
            ref = ref[lo:hi]
        assert torch.equal(t, ref), name
