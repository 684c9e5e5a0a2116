"""DeepSeek-V3 against transformers' DeepseekV3ForCausalLM (fp32, CPU), its router against a
plain Python loop, the router-bias rule, and the family through the product."""

import itertools
import json

import pytest
import torch

from family_checks import SMALL, check_emulated_lr0, check_hf_checkpoint, check_init_checkpoint
from cli_util import run_cli

transformers = pytest.importorskip("transformers")

YARN = {"rope_type": "yarn", "rope_theta": 5000.0, "factor": 4.0,
        "original_max_position_embeddings": 64, "beta_fast": 16, "beta_slow": 2,
        "mscale": 0.8, "mscale_all_dim": 0.7}
# the tiny profile at CPU-small shapes (MLA's own widths on top of family_checks.SMALL)
TINY = ["model.num_key_value_heads=4", "model.head_dim=4", "model.qk_rope_head_dim=4",
        "model.qk_nope_head_dim=8", "model.v_head_dim=6", "model.q_lora_rank=12",
        "model.kv_lora_rank=10", "model.max_position_embeddings=256",
        "model.rope_scaling={rope_type: yarn, factor: 4.0, "
        "original_max_position_embeddings: 16, mscale: 1.0, mscale_all_dim: 0.5}"]


def hf_config(**overrides):
    fields = dict(vocab_size=96, hidden_size=32, intermediate_size=40, moe_intermediate_size=12,
                  num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4,
                  n_routed_experts=12, num_experts_per_tok=3, n_shared_experts=2,
                  routed_scaling_factor=1.7, kv_lora_rank=10, q_lora_rank=14,
                  qk_rope_head_dim=6, v_head_dim=10, qk_nope_head_dim=8, n_group=4,
                  topk_group=2, first_k_dense_replace=2, norm_topk_prob=True,
                  rms_norm_eps=1e-5, rope_parameters=dict(YARN), rope_interleave=True,
                  attention_bias=False, max_position_embeddings=256)
    fields.update(overrides)
    cfg = transformers.DeepseekV3Config(**fields)
    cfg.architectures = ["DeepseekV3ForCausalLM"]
    return cfg


@pytest.mark.parametrize("overrides", [
    {},
    {"q_lora_rank": None, "n_group": 2, "topk_group": 1, "first_k_dense_replace": 0,
     "norm_topk_prob": False, "rope_interleave": False, "attention_bias": True,
     "n_shared_experts": 1, "tie_word_embeddings": True,
     "rope_parameters": {"rope_type": "default", "rope_theta": 3000.0}},
])
def test_transformers_checkpoint_loads_and_matches(tmp_path, overrides):
    ours = check_hf_checkpoint(tmp_path, hf_config(**overrides), seed=3)
    cfg = ours.config
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (12, 3, 12)
    assert cfg.q_lora_rank == overrides.get("q_lora_rank", 14)
    assert cfg.head_dim == cfg.qk_rope_head_dim == 6
    kinds = [layer.is_moe for layer in ours.layers]
    assert kinds == ([False, False, True, True] if not overrides else [True] * 4)
    moe = next(layer.moe for layer in ours.layers if layer.is_moe)
    assert moe.shared_expert.gate_proj.weight.shape == (12 * cfg.n_shared_experts, 32)
    assert moe.shared_expert_gate is None
    # the correction bias came from the checkpoint (randomised there) and is not a parameter
    assert moe.e_score_correction_bias.abs().sum() > 0
    assert "e_score_correction_bias" not in "".join(n for n, _ in ours.named_parameters())
    if not overrides:
        assert cfg.rope_scaling["factor"] == 4.0 and cfg.rope_theta == 5000.0


def test_correction_bias_moves_the_choice_not_the_weights():
    """A large bias on one expert makes every token pick it, with its raw score as weight."""
    from moegraph_cli import models

    ours = models.from_profile("tiny-deepseek-v3", dtype=torch.float32,
                               overrides=[*SMALL, *TINY, "model.norm_topk_prob=false",
                                          "model.routed_scaling_factor=1.0"])
    moe = ours.layers[1].moe
    x = torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(0))
    from moegraph_cli.moe.routing import route_grouped

    x_TH = moe.post_norm(x).view(10, 32)
    args = (x_TH, moe.router.weight, moe.e_score_correction_bias, 4, 4, 2, False, 1.0)
    ids0, w0, _ = route_grouped(*args)
    with torch.no_grad():
        moe.e_score_correction_bias[13] = 10.0
    ids1, w1, _ = route_grouped(*args)
    assert (ids1 == 13).any(dim=1).all() and not (ids0 == 13).all()
    scores = torch.sigmoid(x_TH @ moe.router.weight.t())
    torch.testing.assert_close(w1, scores.gather(1, ids1))


def loop_route(scores, bias, top_k, n_group, topk_group, norm, scale):
    """The router in plain Python: the best groups by the sum of their two best biased
    scores, then the best experts in them; ties go to the lower index."""
    ids, weights = [], []
    for s_row, in zip(scores.tolist()):
        choice = [s + b for s, b in zip(s_row, bias.tolist())]
        per = len(choice) // n_group
        group_score = [sum(sorted(choice[g * per:(g + 1) * per], reverse=True)[:2])
                       for g in range(n_group)]
        groups = sorted(range(n_group), key=lambda g: (-group_score[g], g))[:topk_group]
        allowed = [e for e in range(len(choice)) if e // per in groups]
        picked = sorted(allowed, key=lambda e: (-choice[e], e))[:top_k]
        w = [s_row[e] for e in picked]
        if norm:
            total = sum(w) + 1e-20
            w = [v / total for v in w]
        ids.append(picked)
        weights.append([v * scale for v in w])
    return torch.tensor(ids), torch.tensor(weights, dtype=torch.float64)


@pytest.mark.parametrize("E,G,TG,K,norm,ties", [
    (16, 4, 2, 4, True, False), (16, 4, 2, 4, True, True), (12, 3, 1, 4, False, True),
    (8, 1, 1, 8, True, False), (10, 5, 5, 3, False, True), (7 * 4, 4, 3, 6, True, True)])
def test_grouped_topk_matches_a_python_loop(E, G, TG, K, norm, ties):
    from moegraph_cli.moe.routing import route_grouped

    gen = torch.Generator().manual_seed(E * 10 + G)
    T, H = 37, 8
    w = torch.randn(E, H, generator=gen, dtype=torch.float64).float()
    x = torch.randn(T, H, generator=gen)
    bias = torch.randn(E, generator=gen) * 0.1
    if ties:  # whole rows of equal scores, equal biases: every choice is a tie
        x[::3] = 0.0
        bias[: E // 2] = 0.0
        bias[E // 2:] = 0.25
    ids, weights, _ = route_grouped(x, w, bias, K, G, TG, norm, 2.5)
    scores = torch.sigmoid(torch.nn.functional.linear(x.float(), w.float()))
    want_ids, want_w = loop_route(scores, bias, K, G, TG, norm, 2.5)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(weights.double(), want_w, rtol=1e-6, atol=1e-7)


def test_bias_update_rule_on_the_device():
    """moe.bias_update_rate: after each step bias += rate * sign(mean load - load), the load
    counted from that step's routes; off by default."""
    from moegraph_cli import models
    from moegraph_cli.train.trainer import Trainer, batches

    overrides = [*SMALL, *TINY]
    off = models.from_profile("tiny-deepseek-v3", dtype=torch.float32, overrides=overrides)
    Trainer(off, lr=0.0).step(next(batches(128, 2, 16, 0, "cpu")))
    assert all(layer.moe.e_score_correction_bias.abs().sum() == 0
               for layer in off.layers if layer.is_moe)

    model = models.from_profile("tiny-deepseek-v3", dtype=torch.float32,
                                overrides=[*overrides, "moe.bias_update_rate=0.01"])
    ids = next(batches(128, 2, 16, 0, "cpu"))
    moe = model.layers[1].moe
    model.rope_tables(16, torch.float32, "cpu")
    with torch.no_grad():  # the routes the step will take (lr 0: the same weights)
        x_TH = moe.post_norm(model.layers[1].attn(
            model.layers[0](model.embed_tokens(ids))[0])).reshape(-1, 32)
    from moegraph_cli.moe.routing import expert_load_E, route_grouped

    ids_TK = route_grouped(x_TH, moe.router.weight, moe.e_score_correction_bias, 4, 4, 2,
                           True, 2.5)[0]
    load = expert_load_E(ids_TK, 16)
    assert load.sum() == 32 * 4
    Trainer(model, lr=0.0).step(ids)
    want = 0.01 * torch.sign(load.mean() - load)
    assert torch.equal(moe.e_score_correction_bias, want)
    assert (want != 0).any() and moe.expert_load.abs().sum() == 0  # counted anew next step
    assert not moe.e_score_correction_bias.requires_grad


@pytest.mark.parametrize("overrides", [[], ["model.q_lora_rank=null", "model.n_group=2",
                                            "model.topk_group=1", "model.rope_interleave=false",
                                            "model.attention_bias=true",
                                            "model.first_k_dense_replace=0",
                                            "model.rope_scaling=null"]])
def test_init_checkpoint_loads_in_transformers(tmp_path, overrides):
    ours, theirs = check_init_checkpoint(tmp_path, "tiny-deepseek-v3", [*TINY, *overrides])
    written = json.loads((tmp_path / "init" / "config.json").read_text())
    assert written["model_type"] == "deepseek_v3"
    assert written["n_routed_experts"] == 16 and written["q_lora_rank"] == ours.config.q_lora_rank
    assert theirs.config.n_group == ours.config.n_group


@pytest.mark.parametrize("extra", [[], ["moe.mode=capacity", "moe.capacity_factor=0.5",
                                        "model.q_lora_rank=null"],
                                   ["moe.backend=permute_free"]])
def test_graphs_lr0_bitwise(extra):
    check_emulated_lr0("tiny-deepseek-v3", [*TINY, *extra])


def test_inspect_and_plan():
    code, out, err = run_cli("inspect", "--profile", "tiny-deepseek-v3", "--json")
    assert code == 0, err
    info = json.loads(out)
    arch = info["architecture"]
    assert arch["model_type"] == "deepseek_v3"
    assert (arch["q_lora_rank"], arch["kv_lora_rank"], arch["rope_type"]) == (256, 128, "yarn")
    assert (arch["n_group"], arch["topk_group"], arch["first_k_dense_replace"]) == (4, 2, 1)
    assert arch["shared_expert_intermediate"] == 256  # 1 shared expert of width 256
    assert [g["kind"] for g in info["layer_groups"]] == ["dense", "moe"]
    shapes = {k: v for g in info["layer_groups"] for k, v in g["shapes"].items()}
    assert shapes["attn.q_a_proj.weight"] == [256, 512]
    assert shapes["attn.kv_a_proj_with_mqa.weight"] == [128 + 32, 512]
    assert shapes["attn.kv_b_proj.weight"] == [8 * (64 + 64), 128]
    assert shapes["moe.shared_expert.up_proj.weight"] == [256, 512]
    code, out, err = run_cli("plan", "--profile", "tiny-deepseek-v3", "--budget", "8GiB",
                             "--json")
    assert code == 0, err


@pytest.mark.parametrize("profile,budget,params", [
    ("deepseek-v3", "6TiB", 671.0e9), ("moonlight-16b-a3b", "140GiB", 15.96e9),
    ("moonlight-16b-a3b-4layer", "140GiB", None)])
def test_published_profiles_inspect_and_plan_on_the_cpu(profile, budget, params):
    code, out, err = run_cli("inspect", "--profile", profile, "--json")
    assert code == 0, err
    total = json.loads(out)["params"]["total"]
    if params is not None:  # DeepSeek-V3: 671B without its MTP layer
        assert abs(total - params) / params < 1e-3, total
    code, out, err = run_cli("plan", "--profile", profile, "--budget", budget, "--json")
    assert code == 0, err
    plan = json.loads(out)
    assert 0 < plan["required_budget"] <= plan["budget"]
    assert plan["static_bytes"] > 8 * total  # weights, grads and two AdamW states


def test_published_config_spellings_read_as_the_profile():
    """DeepSeek-V3's config.json as published (transformers 4.x: rope_scaling with "type",
    fields transformers ignores) and as transformers 5.x writes it (rope_parameters,
    num_local_experts) both read as the deepseek-v3 profile."""
    from moegraph_cli.config import ModelConfig, load_profile

    cfg = load_profile("deepseek-v3").model
    d = cfg.to_hf_dict()
    v4 = {**d, "rope_scaling": {**{k: v for k, v in d["rope_scaling"].items()
                                   if k != "rope_type"}, "type": "yarn"},
          "moe_layer_freq": 1, "topk_method": "noaux_tc", "scoring_func": "sigmoid",
          "num_nextn_predict_layers": 1, "aux_loss_alpha": 0.001}
    assert ModelConfig.from_hf_dict(v4) == cfg
    v5 = {k: v for k, v in d.items() if k not in ("rope_theta", "rope_scaling",
                                                  "n_routed_experts")}
    v5.update(rope_parameters={**d["rope_scaling"], "rope_theta": 10000.0},
              num_local_experts=256, head_dim=64)
    assert ModelConfig.from_hf_dict(v5) == cfg
    from moegraph_cli.errors import UsageError

    with pytest.raises(UsageError, match="rope type 'longrope' is not supported"):
        ModelConfig.from_hf_dict({**d, "rope_scaling": {"rope_type": "longrope"}})
    with pytest.raises(UsageError, match="n_group"):
        ModelConfig.from_hf_dict({**d, "n_group": 3})


def test_router_bias_stays_fp32_in_a_bf16_model(tmp_path):
    """The bias and the load count are fp32 in a bf16 model (a 1e-3 step survives where bf16
    would round it away); the state dict, and so the checkpoint, holds the model's dtype."""
    from moegraph_cli import models
    from moegraph_cli.io.checkpoint_save import save_checkpoint

    model = models.from_profile("tiny-deepseek-v3", dtype="bfloat16",
                                overrides=[*SMALL, *TINY, "run.dtype=bfloat16",
                                           "moe.bias_update_rate=0.001"])
    moe = model.layers[1].moe
    assert moe.e_score_correction_bias.dtype == moe.expert_load.dtype == torch.float32
    assert moe.router.weight.dtype == torch.bfloat16
    with torch.no_grad():
        moe.e_score_correction_bias.fill_(0.5)
        moe.expert_load.copy_(torch.arange(16.0))
    from moegraph_cli.models.common.ffn import update_router_bias_

    update_router_bias_(model)
    assert moe.e_score_correction_bias[0].item() == pytest.approx(0.501)  # bf16: 0.5
    assert moe.e_score_correction_bias[15].item() == pytest.approx(0.499)
    state = model.state_dict()
    assert state["layers.1.moe.e_score_correction_bias"].dtype == torch.bfloat16
    save_checkpoint(state, model.config, tmp_path / "ck")
    again = models.from_pretrained(tmp_path / "ck")
    bias = again.layers[1].moe.e_score_correction_bias
    assert bias.dtype == torch.float32 and again.layers[1].moe.router.weight.dtype == torch.bfloat16
    assert torch.equal(bias, state["layers.1.moe.e_score_correction_bias"].float())


def test_bias_update_with_graphs_matches_eager():
    """The load is counted inside the captured moe scope and the bias moved after the step,
    outside the graphs: eager and graphed models keep bitwise equal biases and losses."""
    from moegraph_cli import models
    from moegraph_cli.graphs import GraphSession
    from moegraph_cli.graphs.backend import EmulatedGraphs
    from moegraph_cli.train.harness import GraphTrainer, dropped_routes, scope_specs
    from moegraph_cli.train.trainer import batches

    def build():
        return models.from_profile("tiny-deepseek-v3", dtype=torch.float32,
                                   overrides=[*SMALL, *TINY, "moe.bias_update_rate=0.05"])

    eager, graphed = build(), build()
    te, tg = GraphTrainer(eager, lr=0.0), GraphTrainer(graphed, lr=0.0)
    session = GraphSession(scope_specs(graphed, ["attn", "moe"]), strategy="shared",
                           backend=EmulatedGraphs(), warmup_iters=1)
    ids = next(batches(128, 2, 16, 0, "cpu"))
    session.record(lambda: graphed(ids, labels=ids))
    assert session.capture(), session.failure
    session.install()
    dropped_routes(graphed, reset=True)  # as `capture` does after warm-up and recording
    tg.session = session
    ie, ig = batches(128, 2, 16, 1, "cpu"), batches(128, 2, 16, 1, "cpu")
    for _ in range(3):
        assert te.step(next(ie)).item() == tg.step(next(ig)).item()
        for a, b in zip(eager.layers[1:], graphed.layers[1:]):
            assert torch.equal(a.moe.e_score_correction_bias, b.moe.e_score_correction_bias)
    assert eager.layers[1].moe.e_score_correction_bias.abs().sum() > 0
    assert session.stats()["totals"]["replayed"] == 3 * len(session.scopes)
