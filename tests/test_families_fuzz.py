"""Bad GPT-OSS and DeepSeek-V3 checkpoints (config.json fields, MXFP4 tensors, the GPT-OSS
expert layouts, shards): each is refused by `models.from_pretrained` with a one-line
MoegraphError naming the field, tensor or file at fault, and by `moegraph inspect -c`, `plan -c`
(and for some `verify -c` / `init`) with that line, the error's exit code (2 for a bad
config.json, 1 for a damaged checkpoint, 2 for a missing file) and no traceback. Inputs that
are odd but mean one thing load, and load the right values."""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

from cli_util import run_cli
from test_loaders_fuzz import FUZZ, document_bytes, fresh, refuses_cleanly
from moegraph_cli import models
from moegraph_cli.io.hf_names import INDEX_FILE, SINGLE_FILE, hf_to_moegraph_names
from moegraph_cli.config import read_hf_config
from moegraph_cli.errors import CheckpointError, MoegraphError, UsageError

SMALL = ["model.vocab_size=128", "model.hidden_size=32", "model.num_attention_heads=4",
         "model.num_key_value_heads=2", "model.head_dim=8", "model.moe_intermediate_size=32",
         "model.intermediate_size=48", "run.dtype=float32"]
MLA = ["model.num_key_value_heads=4", "model.q_lora_rank=16", "model.kv_lora_rank=16",
       "model.qk_nope_head_dim=8", "model.qk_rope_head_dim=8", "model.head_dim=8",
       "model.v_head_dim=8"]
SETS = {"gpt": ("tiny-gpt-oss", SMALL), "ds": ("tiny-deepseek-v3", SMALL + MLA)}
GATE_UP = "model.layers.1.mlp.experts.gate_up_proj"  # GPT-OSS, [E, H, 2F] = [8, 32, 64]
FP4 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                    -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def _init(root, name, profile, sets, *extra):
    args = [a for kv in sets for a in ("--set", kv)]
    code, _, err = run_cli("init", profile, root / name, *args, *extra, "--json")
    assert code == 0, err
    return root / name


def quantize_mxfp4(w_EAB):
    """(blocks [E, B, A/32, 16], scales [E, B, A/32]) of an HF tensor [E, A, B]."""
    g = w_EAB.float().transpose(1, 2).unflatten(-1, (-1, 32))
    exp = torch.ceil(torch.log2(g.abs().amax(-1, keepdim=True).clamp_min(1e-30) / 6.0))
    exp = exp.clamp(-127, 127)
    codes = (g / torch.exp2(exp))[..., None].sub(FP4).abs().argmin(-1).to(torch.uint8)
    return codes[..., 0::2] | (codes[..., 1::2] << 4), (exp[..., 0] + 127).to(torch.uint8)


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    """Tiny checkpoints: "gpt", "ds", "gsh" (GPT-OSS in 6 shards), "mx" (GPT-OSS with its
    expert weights as MXFP4 and quantization_config mxfp4)."""
    root = tmp_path_factory.mktemp("families")
    out = {fam: _init(root, fam, *SETS[fam]) for fam in SETS}
    out["gsh"] = _init(root, "gsh", *SETS["gpt"], "--max-shard-size", "100KB")
    mx = root / "mx"
    shutil.copytree(out["gpt"], mx)
    tensors = load_file(mx / SINGLE_FILE)
    for key in [k for k in tensors if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        tensors[key + "_blocks"], tensors[key + "_scales"] = quantize_mxfp4(tensors.pop(key))
    save_file(tensors, mx / SINGLE_FILE, metadata={"format": "pt"})
    _edit_config(mx, lambda c: c.update(quantization_config={"quant_method": "mxfp4"}))
    out["mx"] = mx
    return out


def _edit_config(d, edit):
    config = json.loads((d / "config.json").read_text())
    edit(config)
    (d / "config.json").write_text(json.dumps(config))


def _edit_tensors(d, edit, file=SINGLE_FILE):
    tensors = load_file(d / file)
    edit(tensors)
    save_file(tensors, d / file, metadata={"format": "pt"})


def _copy(bases, base, tmp_path):
    d = tmp_path / "ckpt"
    shutil.copytree(bases[base], d)
    return d


def _state(d):
    return models.from_pretrained(d, dtype=torch.float32).state_dict()


def one_line(code, out, err, expected_code, needles):
    assert code == expected_code, (code, out, err)
    lines = [line for line in err.strip().splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("moegraph: error: "), err
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    assert "internal error" not in err and "Traceback" not in out + err


def refused(d, error, code, needles, commands=("inspect", "plan")):
    """from_pretrained raises `error` (one line, the needles), and each CLI command exits
    with `code` and that one line."""
    with pytest.raises(MoegraphError) as e:
        models.from_pretrained(d, dtype=torch.float32)
    assert type(e.value) is error and e.value.exit_code == code, repr(e.value)
    assert "\n" not in str(e.value)
    for needle in needles:
        assert needle in str(e.value), (needle, str(e.value))
    argv = {"inspect": ["inspect", "-c", d], "plan": ["plan", "-c", d, "--budget", "80GiB"],
            "verify": ["verify", "-c", d, "--set", "run.device=cpu", "--steps", "1"]}
    for cmd in commands:
        one_line(*run_cli(*argv[cmd]), code, needles)


def _rope(**values):
    """An edit setting yarn values in both rope spellings GPT-OSS writes (DeepSeek: one)."""
    def edit(c):
        for name in ("rope_scaling", "rope_parameters"):
            if c.get(name):
                c[name].update(values)
    return edit


def _drop(*names):
    return lambda c: [c.pop(n, None) for n in names]


# -- config.json ------------------------------------------------------------------------------
GPT_REQUIRED = ["vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads", "num_experts_per_tok", "num_local_experts",
                "rms_norm_eps", "router_aux_loss_coef", "tie_word_embeddings"]
DS_REQUIRED = ["vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size",
               "num_hidden_layers", "num_attention_heads", "num_experts_per_tok",
               "n_shared_experts", "routed_scaling_factor", "kv_lora_rank", "q_lora_rank",
               "qk_rope_head_dim", "v_head_dim", "qk_nope_head_dim", "n_group", "topk_group",
               "first_k_dense_replace", "norm_topk_prob", "rms_norm_eps", "tie_word_embeddings",
               "rope_theta", "rope_interleave", "attention_bias", "n_routed_experts"]
CONFIG_CASES = [
    *[(f"gpt-no-{f}", "gpt", _drop(f), [f"missing required field '{f}'"])
      for f in GPT_REQUIRED],
    *[(f"ds-no-{f}", "ds", _drop(f), [f"missing required field '{f}'"]) for f in DS_REQUIRED],
    # GPT-OSS
    ("layer-types-short", "gpt", lambda c: c.update(layer_types=["full_attention"]),
     ["layer_types must", "each of the 3 layers"]),
    ("layer-types-long", "gpt", lambda c: c.update(layer_types=["full_attention"] * 4),
     ["layer_types must", "each of the 3 layers"]),
    ("layer-types-unknown", "gpt",
     lambda c: c.update(layer_types=["full_attention", "chunked_attention", "full_attention"]),
     ["layer_types must list 'sliding_attention' or 'full_attention'", "chunked_attention"]),
    ("layer-types-empty", "gpt", lambda c: c.update(layer_types=[]), ["layer_types must"]),
    ("layer-types-string", "gpt", lambda c: c.update(layer_types="full_attention"),
     ["layer_types: expected a list"]),
    ("layers-a-string", "gpt", lambda c: (c.pop("layer_types"), c.update(num_hidden_layers="3")),
     ["num_hidden_layers: expected int, got '3'"]),
    ("layers-huge", "gpt", lambda c: (c.pop("layer_types"), c.update(num_hidden_layers=10**12)),
     ["num_hidden_layers 1000000000000 is too large"]),
    ("sliding-window-0", "gpt", lambda c: c.update(sliding_window=0),
     ["sliding_window must be positive or null, got 0"]),
    ("sliding-window-negative", "gpt", lambda c: c.update(sliding_window=-4),
     ["sliding_window must be positive or null, got -4"]),
    ("sliding-window-null", "gpt", lambda c: c.update(sliding_window=None),
     ["sliding_window must be set for gpt_oss", "'sliding_attention'"]),
    ("sliding-window-string", "gpt", lambda c: c.update(sliding_window="128"),
     ["sliding_window: expected int"]),
    ("init-range-huge", "gpt", lambda c: c.update(initializer_range=1e30),
     ["initializer_range must be in [0, 1]", "got 1e+30"]),
    ("init-range-negative", "ds", lambda c: c.update(initializer_range=-0.02),
     ["initializer_range must be in [0, 1]", "got -0.02"]),
    ("swiglu-limit-0", "gpt", lambda c: c.update(swiglu_limit=0),
     ["swiglu_limit must be positive"]),
    ("swiglu-limit-negative", "gpt", lambda c: c.update(swiglu_limit=-1.0),
     ["swiglu_limit must be positive"]),
    ("swiglu-limit-nan", "gpt", lambda c: c.update(swiglu_limit=math.nan),
     ["swiglu_limit: expected a finite number, got nan"]),
    ("swiglu-limit-string", "gpt", lambda c: c.update(swiglu_limit="7"),
     ["swiglu_limit: expected float, got '7'"]),
    ("swiglu-limit-null", "gpt", lambda c: c.update(swiglu_limit=None),
     ["swiglu_limit and swiglu_alpha must be set"]),
    ("swiglu-alpha-null", "gpt", lambda c: c.update(swiglu_alpha=None),
     ["swiglu_limit and swiglu_alpha must be set"]),
    ("experts-spellings-differ", "gpt", lambda c: c.update(num_experts=4),
     ["num_local_experts 8 and num_experts 4 disagree"]),
    ("top-k-spellings-differ", "gpt", lambda c: c.update(experts_per_token=3),
     ["num_experts_per_tok 2 and experts_per_token 3 disagree"]),
    ("expert-width-a-string", "gpt", lambda c: c.update(intermediate_size="32"),
     ["intermediate_size: expected int, got '32'"]),
    ("quant-not-an-object", "gpt", lambda c: c.update(quantization_config=[]),
     ["quantization_config must be an object or null, got []"]),
    ("quant-a-string", "gpt", lambda c: c.update(quantization_config="mxfp4"),
     ["quantization_config must be an object or null, got 'mxfp4'"]),
    ("quant-method-a-list", "gpt",
     lambda c: c.update(quantization_config={"quant_method": ["mxfp4"]}),
     ["quantization_config.quant_method ['mxfp4'] is not supported for gpt_oss"]),
    ("quant-method-unknown", "gpt", lambda c: c.update(quantization_config={"quant_method": "awq"}),
     ["quantization_config.quant_method 'awq' is not supported for gpt_oss"]),
    ("quant-method-missing", "gpt", lambda c: c.update(quantization_config={}),
     ["quantization_config.quant_method None is not supported"]),
    ("gpt-rope-unknown", "gpt",
     lambda c: c.update(rope_scaling={"rope_type": "longrope"}, rope_parameters=None),
     ["rope type 'longrope' is not supported"]),
    ("gpt-rope-factor-0", "gpt", _rope(factor=0), ["rope_scaling.factor must be positive, got 0"]),
    ("gpt-rope-factor-negative", "gpt", _rope(factor=-2.0),
     ["rope_scaling.factor must be positive, got -2.0"]),
    ("gpt-rope-factor-string", "gpt", _rope(factor="x"),
     ["rope_scaling.factor must be a finite number, got 'x'"]),
    ("gpt-rope-original-0", "gpt", _rope(original_max_position_embeddings=0),
     ["rope_scaling.original_max_position_embeddings must be an integer in 1.."]),
    ("gpt-rope-beta-string", "gpt", _rope(beta_fast="x"),
     ["rope_scaling.beta_fast must be a finite number, got 'x'"]),
    ("gpt-rope-truncate-string", "gpt", _rope(truncate="no"),
     ["rope_scaling.truncate must be true or false, got 'no'"]),
    # DeepSeek-V3
    ("n-group-not-dividing", "ds", lambda c: c.update(n_group=3),
     ["num_experts 16 must split into n_group 3 groups"]),
    ("n-group-0", "ds", lambda c: c.update(n_group=0), ["n_group 0"]),
    ("topk-group-over-n-group", "ds", lambda c: c.update(topk_group=5),
     ["topk_group must be in 1..n_group (4), got 5"]),
    ("topk-over-groups", "ds", lambda c: c.update(topk_group=1, num_experts_per_tok=5),
     ["num_experts_per_tok 5 must be at most topk_group x experts per group (4)"]),
    ("q-lora-rank-0", "ds", lambda c: c.update(q_lora_rank=0),
     ["q_lora_rank must be positive or null, got 0"]),
    ("kv-lora-rank-0", "ds", lambda c: c.update(kv_lora_rank=0),
     ["kv_lora_rank must be positive"]),
    ("kv-lora-rank-null", "ds", lambda c: c.update(kv_lora_rank=None),
     ["missing required field 'kv_lora_rank'"]),
    ("qk-rope-head-dim-string", "ds", lambda c: c.update(qk_rope_head_dim="8"),
     ["qk_rope_head_dim: expected int, got '8'"]),
    ("n-routed-experts-string", "ds", lambda c: c.update(n_routed_experts="16"),
     ["n_routed_experts: expected int, got '16'"]),
    ("ds-experts-spellings-differ", "ds", lambda c: c.update(num_local_experts=8),
     ["n_routed_experts 16 and num_local_experts 8 disagree"]),
    ("ds-rope-unknown", "ds", _rope(rope_type="longrope"), ["rope type 'longrope'"]),
    ("ds-rope-dynamic", "ds", lambda c: c.update(rope_scaling={"type": "dynamic", "factor": 2.0}),
     ["rope type 'dynamic' is not supported"]),
    ("ds-rope-no-type", "ds", lambda c: c["rope_scaling"].pop("rope_type"),
     ["rope_scaling has no rope_type"]),
    ("ds-rope-factor-0", "ds", _rope(factor=0), ["rope_scaling.factor must be positive, got 0"]),
    ("ds-rope-factor-negative", "ds", _rope(factor=-1.0), ["rope_scaling.factor must be positive"]),
    ("ds-rope-factor-null", "ds", _rope(factor=None), ["rope_scaling needs factor for yarn"]),
    ("ds-rope-factor-string", "ds", _rope(factor="4"),
     ["rope_scaling.factor must be a finite number, got '4'"]),
    ("ds-rope-mscale-string", "ds", _rope(mscale="1"),
     ["rope_scaling.mscale must be a finite number, got '1'"]),
    ("ds-rope-original-negative", "ds", _rope(original_max_position_embeddings=-5),
     ["rope_scaling.original_max_position_embeddings must be an integer in 1..2147483647, "
      "got -5"]),
    # The fuzzer's find (original false is a bool, not an integer: math.log(0) in the rope),
    # and the other values the yarn arithmetic takes a log of or divides by.
    ("ds-rope-original-false", "ds", _rope(original_max_position_embeddings=False),
     ["rope_scaling.original_max_position_embeddings must be an integer in 1..2147483647, "
      "got False"]),
    ("ds-rope-original-float", "ds", _rope(original_max_position_embeddings=4096.0),
     ["original_max_position_embeddings must be an integer"]),
    ("ds-rope-beta-negative", "ds", _rope(beta_fast=-32),
     ["rope_scaling.beta_fast must be >= 0, got -32"]),
    ("ds-rope-mscale-all-dim-negative", "ds", _rope(mscale_all_dim=-1.0),
     ["rope_scaling.mscale_all_dim must be >= 0, got -1.0"]),
    ("ds-rope-theta-1", "ds", lambda c: c.update(rope_theta=1.0),
     ["rope_scaling (yarn) needs rope_theta other than 1"]),
    ("gpt-rope-beta-slow-negative", "gpt", _rope(beta_slow=-1.0),
     ["rope_scaling.beta_slow must be >= 0, got -1.0"]),
    ("fp8", "ds", lambda c: c.update(quantization_config={
        "quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}),
     ["quantization_config.quant_method 'fp8' is not supported for deepseek_v3 checkpoints"]),
    ("ds-mxfp4", "ds", lambda c: c.update(quantization_config={"quant_method": "mxfp4"}),
     ["quantization_config.quant_method 'mxfp4' is not supported for deepseek_v3"]),
]


@pytest.mark.parametrize("name,base,edit,needles", CONFIG_CASES,
                         ids=[c[0] for c in CONFIG_CASES])
def test_bad_config_json(bases, tmp_path, name, base, edit, needles):
    d = _copy(bases, base, tmp_path)
    _edit_config(d, edit)
    refused(d, UsageError, 2, [str(d / "config.json") + ": ", *needles])


@pytest.mark.parametrize("text", [b"\xff\xfe{", b"{", b"", b"[]", b'{"model_type": "gpt_oss",'])
def test_config_json_not_a_json_object(bases, tmp_path, text):
    d = _copy(bases, "gpt", tmp_path)
    (d / "config.json").write_bytes(text)
    refused(d, UsageError, 2, [str(d / "config.json") + ": "])


@pytest.mark.parametrize("base,edit,needles", [
    ("gpt", lambda c: c.update(sliding_window=None), ["sliding_window must be set"]),
    ("ds", _rope(factor=0), ["rope_scaling.factor must be positive"]),
    ("ds", lambda c: c.update(quantization_config={"quant_method": "fp8"}), ["'fp8'"]),
])
def test_verify_refuses_before_running(bases, tmp_path, base, edit, needles):
    d = _copy(bases, base, tmp_path)
    _edit_config(d, edit)
    refused(d, UsageError, 2, needles, commands=("verify",))


@pytest.mark.parametrize("family,item,needles", [
    ("gpt", "model.sliding_window=null", ["model.sliding_window must be set for gpt_oss"]),
    ("gpt", "model.rope_scaling={rope_type: yarn, factor: x, original_max_position_embeddings: 64}",
     ["model.rope_scaling.factor must be a finite number, got 'x'"]),
    ("gpt", "model.rope_scaling={rope_type: yarn, factor: 0, original_max_position_embeddings: 64}",
     ["model.rope_scaling.factor must be positive"]),
    ("ds", "model.rope_scaling={rope_type: yarn, factor: 4.0, original_max_position_embeddings: "
     "1024, mscale: x}", ["model.rope_scaling.mscale must be a finite number"]),
    ("ds", "model.rope_scaling={rope_type: yarn, original_max_position_embeddings: 1024}",
     ["model.rope_scaling needs factor"]),
    ("ds", "model.n_group=3", ["model.num_experts 16 must split into n_group 3"]),
])
def test_init_refuses_what_would_not_load(tmp_path, family, item, needles):
    profile, sets = SETS[family]
    args = [a for kv in [*sets, item] for a in ("--set", kv)]
    one_line(*run_cli("init", profile, tmp_path / "out", *args), 2, needles)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("base,edit", [
    ("gpt", lambda c: c.update(num_experts=8, experts_per_token=2)),  # same values, both spelt
    ("gpt", lambda c: c.update(quantization_config={"quant_method": "mxfp4"})),  # unquantised
    ("gpt", lambda c: c.update(quantization_config={"quant_method": "mxfp4",
                                                    "modules_to_not_convert": 5})),
    ("ds", lambda c: c.update(num_experts=16)),
    ("ds", lambda c: c.update(rope_parameters=c.pop("rope_scaling"))),  # 5.x's spelling
])
def test_odd_but_unambiguous_configs_load_the_same_values(bases, tmp_path, base, edit):
    d = _copy(bases, base, tmp_path)
    _edit_config(d, edit)
    want, got = _state(bases[base]), _state(d)
    assert list(got) == list(want)
    for k in want:
        assert torch.equal(got[k], want[k]), k


def test_sliding_window_null_loads_when_no_layer_slides(bases, tmp_path):
    d = _copy(bases, "gpt", tmp_path)
    _edit_config(d, lambda c: c.update(sliding_window=None, layer_types=["full_attention"] * 3))
    model = models.from_pretrained(d, dtype=torch.float32)
    assert [layer.attn.sliding_window for layer in model.layers] == [None, None, None]


# -- MXFP4 ------------------------------------------------------------------------------------
B, S = GATE_UP + "_blocks", GATE_UP + "_scales"
MXFP4_CASES = [
    ("scales-missing", lambda t: t.pop(S), [S + " is missing from model.safetensors", B]),
    ("blocks-missing", lambda t: t.pop(B), [B + " is missing from model.safetensors", S]),
    ("blocks-int8", lambda t: t.update({B: t[B].to(torch.int8)}),
     [B + " in model.safetensors is I8 [8, 64, 1, 16]", "are U8 [8, 64, 1, 16]"]),
    ("blocks-float", lambda t: t.update({B: t[B].float()}), [B, "is F32"]),
    ("blocks-rank-3", lambda t: t.update({B: t[B].flatten(-2)}), [B, "is U8 [8, 64, 16]"]),
    ("blocks-last-dim-8", lambda t: t.update({B: t[B][..., :8].contiguous()}),
     [B, "is U8 [8, 64, 1, 8]"]),
    ("blocks-groups-2", lambda t: t.update({B: torch.cat([t[B]] * 2, 2)}),
     [B, "is U8 [8, 64, 2, 16]", GATE_UP + " [8, 32, 64]"]),
    ("scales-rank-4", lambda t: t.update({S: t[S][..., None].contiguous()}),
     [S, "is U8 [8, 64, 1, 1]", "are U8 [8, 64, 1]"]),
    ("scales-f16", lambda t: t.update({S: t[S].half()}), [S, "is F16 [8, 64, 1]"]),
    ("plain-and-packed", lambda t: t.update({GATE_UP: torch.zeros(8, 32, 64)}),
     [B, "is not a parameter of the config's model"]),
    ("bias-packed", lambda t: t.update({GATE_UP + "_bias_blocks": torch.zeros(8, 64, 0, 16,
                                                                          dtype=torch.uint8),
                                        GATE_UP + "_bias_scales": torch.zeros(8, 64, 0,
                                                                          dtype=torch.uint8)})
     or t.pop(GATE_UP + "_bias"),
     [GATE_UP + "_bias [8, 64] cannot be stored as mxfp4"]),
]


@pytest.mark.parametrize("name,edit,needles", MXFP4_CASES, ids=[c[0] for c in MXFP4_CASES])
def test_bad_mxfp4_tensors(bases, tmp_path, name, edit, needles):
    d = _copy(bases, "mx", tmp_path)
    _edit_tensors(d, edit)
    refused(d, CheckpointError, 1, ["checkpoint: tensor ", *needles])


def test_mxfp4_nan_scale_is_refused_when_read(bases, tmp_path):
    """E8M0 255 is NaN: it would load as inf weights and NaN losses. inspect and plan read
    headers only; loading (here through verify) reads the values."""
    d = _copy(bases, "mx", tmp_path)
    _edit_tensors(d, lambda t: t[S].view(-1)[5:7].fill_(255))
    refused(d, CheckpointError, 1, [f"checkpoint: tensor {S} in model.safetensors holds the "
                                    "E8M0 NaN scale 255"], commands=("verify",))
    from moegraph_cli.io.checkpoint_local import load_local_

    cfg = read_hf_config(d)
    with pytest.raises(CheckpointError, match="E8M0 NaN scale 255"):  # the sharded loader too
        load_local_(models.MoeCausalLM(cfg).float(), d, cfg)


def test_mxfp4_loads_without_quantization_config_and_as_transformers_would(bases, tmp_path):
    """The tensors say they are MXFP4: the same values with or without quantization_config,
    and within FP4's rounding of the unquantised weights."""
    d = _copy(bases, "mx", tmp_path)
    _edit_config(d, _drop("quantization_config"))
    packed, plain, got = _state(bases["mx"]), _state(bases["gpt"]), _state(d)
    for k in packed:
        assert torch.equal(got[k], packed[k]), k
    w = plain["layers.1.moe.w_gate_up"]
    assert not torch.equal(got["layers.1.moe.w_gate_up"], w)
    assert (got["layers.1.moe.w_gate_up"] - w).abs().max() <= w.abs().max() / 4


def test_mxfp4_in_a_family_without_it(bases, tmp_path):
    d = _copy(bases, "ds", tmp_path)
    key = "model.layers.1.mlp.experts.0.up_proj.weight"
    _edit_tensors(d, lambda t: t.update({key + "_blocks": torch.zeros(32, 1, 16, dtype=torch.uint8),
                                         key + "_scales": torch.zeros(32, 1, dtype=torch.uint8)})
                  or t.pop(key))
    refused(d, CheckpointError, 1, [f"tensor {key} is stored as mxfp4 ({key}_blocks in "
                                    "model.safetensors), which deepseek_v3 checkpoints do not"])


# -- layouts and other tensors ----------------------------------------------------------------
TENSOR_CASES = [
    ("gate-up-transposed", "gpt", lambda t: t.update({GATE_UP: t[GATE_UP].transpose(1, 2)
                                                      .contiguous()}),
     [GATE_UP + " in model.safetensors has shape [8, 64, 32], config says [8, 32, 64]"]),
    ("gate-up-odd-width", "gpt", lambda t: t.update({GATE_UP: t[GATE_UP][..., :63].contiguous()}),
     [GATE_UP, "has shape [8, 32, 63]"]),
    ("gate-up-bias-length", "gpt", lambda t: t.update({GATE_UP + "_bias": torch.zeros(8, 60)}),
     [GATE_UP + "_bias in model.safetensors has shape [8, 60], config says [8, 64]"]),
    ("down-bias-length", "gpt",
     lambda t: t.update({"model.layers.0.mlp.experts.down_proj_bias": torch.zeros(8, 31)}),
     ["model.layers.0.mlp.experts.down_proj_bias", "has shape [8, 31], config says [8, 32]"]),
    ("sinks-length", "gpt", lambda t: t.update({"model.layers.0.self_attn.sinks": torch.zeros(5)}),
     ["model.layers.0.self_attn.sinks", "has shape [5], config says [4]"]),
    ("sinks-missing", "gpt", lambda t: t.pop("model.layers.2.self_attn.sinks"),
     ["model.layers.2.self_attn.sinks is missing from model.safetensors"]),
    ("per-expert-and-stacked", "gpt",
     lambda t: t.update({"model.layers.0.mlp.experts.0.gate_proj.weight": torch.zeros(32, 32)}),
     ["model.layers.0.mlp.experts.gate_up_proj", "a layer must use one spelling"]),
    ("one-bias-bf16", "gpt", lambda t: t.update({GATE_UP + "_bias": t[GATE_UP + "_bias"]
                                                 .bfloat16()}),
     [GATE_UP + "_bias in model.safetensors has dtype BF16", "a checkpoint holds one dtype"]),
    ("correction-bias-missing", "ds",
     lambda t: t.pop("model.layers.1.mlp.gate.e_score_correction_bias"),
     ["model.layers.1.mlp.gate.e_score_correction_bias is missing"]),
    ("correction-bias-length", "ds",
     lambda t: t.update({"model.layers.2.mlp.gate.e_score_correction_bias": torch.zeros(8)}),
     ["model.layers.2.mlp.gate.e_score_correction_bias", "has shape [8], config says [16]"]),
    ("fp8-tensor", "ds", lambda t: t.update({
        "model.layers.1.mlp.experts.0.up_proj.weight":
            t["model.layers.1.mlp.experts.0.up_proj.weight"].to(torch.float8_e4m3fn)}),
     ["model.layers.1.mlp.experts.0.up_proj.weight in model.safetensors has dtype F8_E4M3"]),
    ("fp8-scale-inv", "ds", lambda t: t.update({
        "model.layers.1.mlp.experts.0.up_proj.weight_scale_inv": torch.ones(1, 1)}),
     ["model.layers.1.mlp.experts.0.up_proj.weight_scale_inv in model.safetensors is not a "
      "parameter"]),
    ("q-proj-with-q-lora", "ds",
     lambda t: t.update({"model.layers.0.self_attn.q_proj.weight": torch.zeros(64, 32)}),
     ["model.layers.0.self_attn.q_proj.weight in model.safetensors is not a parameter"]),
]


@pytest.mark.parametrize("name,base,edit,needles", TENSOR_CASES,
                         ids=[c[0] for c in TENSOR_CASES])
def test_bad_tensors(bases, tmp_path, name, base, edit, needles):
    d = _copy(bases, base, tmp_path)
    _edit_tensors(d, edit)
    refused(d, CheckpointError, 1, ["checkpoint: tensor ", *needles])


def test_q_lora_rank_null_wants_a_q_proj(bases, tmp_path):
    d = _copy(bases, "ds", tmp_path)
    _edit_config(d, lambda c: c.update(q_lora_rank=None))
    refused(d, CheckpointError, 1,
            ["tensor model.layers.0.self_attn.q_proj.weight is missing from model.safetensors"])


# -- files ------------------------------------------------------------------------------------
SHARD = "model-00003-of-00006.safetensors"


def _truncate(d, keep=None):
    raw = (d / SHARD).read_bytes()
    (d / SHARD).write_bytes(raw[:keep] if keep is not None else raw[:-100])


def _move_in_index(d):
    index = json.loads((d / INDEX_FILE).read_text())
    key = next(k for k, f in index["weight_map"].items() if f == SHARD)
    index["weight_map"][key] = "model-00001-of-00006.safetensors"
    (d / INDEX_FILE).write_text(json.dumps(index))
    return key


def _duplicate(d):
    first = load_file(d / "model-00001-of-00006.safetensors")
    key = next(iter(first))
    _edit_tensors(d, lambda t: t.update({key: first[key]}), file=SHARD)


FILE_CASES = [
    ("truncated-shard", _truncate, 1, [f"checkpoint: {SHARD} is truncated"]),
    ("truncated-header", lambda d: _truncate(d, 20), 1,
     [f"checkpoint: {SHARD} has a corrupt header"]),
    ("empty-shard", lambda d: _truncate(d, 0), 1, [f"checkpoint: {SHARD} is truncated: 0 bytes"]),
    ("missing-shard", lambda d: (d / SHARD).unlink(), 2,
     [f"{INDEX_FILE} names {SHARD} for tensor", "does not exist"]),
    ("index-wrong-shard", _move_in_index, 1,
     [f"is in {SHARD} but {INDEX_FILE} says model-00001-of-00006.safetensors"]),
    ("duplicate-across-shards", _duplicate, 1,
     [f"tensor model.embed_tokens.weight is in {SHARD} but {INDEX_FILE} says "
      "model-00001-of-00006.safetensors"]),
    ("index-invalid-json", lambda d: (d / INDEX_FILE).write_text("{"), 1,
     [f"checkpoint: {INDEX_FILE} is not valid JSON"]),
    ("index-not-utf8", lambda d: (d / INDEX_FILE).write_bytes(b"\xff\xfe{}"), 1,
     [f"checkpoint: {INDEX_FILE} is not UTF-8 text"]),
    ("index-no-weight-map", lambda d: (d / INDEX_FILE).write_text("[]"), 1,
     [f"checkpoint: {INDEX_FILE} has no weight_map"]),
]


@pytest.mark.parametrize("name,damage,code,needles", FILE_CASES, ids=[c[0] for c in FILE_CASES])
def test_damaged_shards(bases, tmp_path, name, damage, code, needles):
    d = _copy(bases, "gsh", tmp_path)
    damage(d)
    refused(d, CheckpointError, code, needles)


# -- random config.json documents -------------------------------------------------------------
def _load_all_the_way(d):
    """config.json read, its key map built and its rope computed (where bad values surfaced)."""
    from moegraph_cli.models.common.rope import rope_inv_freq, softmax_scale

    cfg = read_hf_config(d)
    if cfg.num_hidden_layers <= 64:
        hf_to_moegraph_names(cfg)
    inv_freq, factor = rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling,
                                     cfg.max_position_embeddings)
    assert torch.isfinite(inv_freq).all() and math.isfinite(factor), cfg.rope_scaling
    assert math.isfinite(softmax_scale(cfg.head_dim, cfg.rope_scaling)), cfg.rope_scaling


@pytest.mark.parametrize("base", ["gpt", "ds"])
@FUZZ
@given(data=st.data())
def test_config_json_mutations(bases, base, data):
    doc = json.loads((bases[base] / "config.json").read_text())
    path = fresh("config.json")
    path.write_bytes(data.draw(document_bytes(doc)))
    refuses_cleanly(lambda: _load_all_the_way(path.parent))
