"""Hugging Face ``MixtralForCausalLM`` and ``Qwen3MoeForCausalLM`` <-> nanotrain's MoE layers.

Routing is the same function on both sides (transformers 5.x ``MixtralTopKRouter`` /
``Qwen3MoeTopKRouter``: softmax over all experts in fp32, top-k, renormalised when
``norm_topk_prob``; dropless), so the mapping is names, layout and which layers are MoE.

On disk (``save_pretrained`` of transformers 5.x writes the original per-expert format, and 4.x
wrote it too; verified by tests/test_hf_mapping.py on the safetensors header):

* Mixtral: ``block_sparse_moe.gate.weight`` [E, H]; expert e: ``block_sparse_moe.experts.{e}.w1``
  (gate, [F, H]), ``w3`` (up), ``w2`` (down, [H, F]). Every layer is MoE;
  ``intermediate_size`` is the expert width (-> ``model.intermediate_size`` and
  ``moe.expert_intermediate_size``); renormalised top-k always; ``router_jitter_noise`` (noise on
  the router input in training) is refused unless 0.
* Qwen3-MoE: ``mlp.gate.weight``; expert e: ``mlp.experts.{e}.gate_proj`` / ``up_proj`` /
  ``down_proj``; dense layers are ``mlp.gate_proj`` ... of ``intermediate_size``, experts
  ``moe_intermediate_size`` wide. Layer i is sparse iff ``i not in mlp_only_layers`` and
  ``(i + 1) % decoder_sparse_step == 0``; nanotrain's MoE layers are every ``layer_frequency``-th
  from ``first_dense_layers``, so a pattern that is not of that form is refused, and export writes
  ``decoder_sparse_step`` (or, for a pattern it cannot give, step 1 and ``mlp_only_layers``).
  transformers 5.x writes the expert count as ``num_local_experts`` (its attribute map) and the
  published configs (and 4.x) as ``num_experts``: both are read (two different values refused)
  and both written. ``norm_topk_prob`` defaults to false.

transformers 5.x also reads (and writes with ``save_original_format=False``) the experts as
fused stacks ``mlp.experts.gate_up_proj`` [E, 2F, H] (rows ``[gate | up]``) and
``mlp.experts.down_proj`` [E, H, F] beside ``mlp.gate.weight``: exactly nanotrain's stacks, read
too (``fused=True``: one piece per stack), never written.
"""

from __future__ import annotations

from typing import Any

from nanotrain.config import ModelArgs
from nanotrain.models import llama_arch
from nanotrain.models.hf_config_json import Mapping, num_layers
from nanotrain.models.hf_mapping import Piece
from nanotrain.models.hf_qwen import window_config


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


class ExpertMapping(Mapping):
    """The names of one expert's tensors (``{e}`` the expert) and of the router, under ``model.layers.{i}.``."""

    ROUTER = "mlp.gate.weight"
    GATE = UP = DOWN = ""

    def expert_pieces(self, hf: str, field: str, args: ModelArgs, fused: bool) -> list[Piece]:
        experts, ffn = args.moe.num_experts, llama_arch.expert_ffn(args)
        if field == "mlp.router.weight":
            return [Piece(hf + ("mlp.gate.weight" if fused else self.ROUTER), 0, experts)]
        if fused and field in ("mlp.experts.gate_up.weight", "mlp.experts.down.weight"):
            return [Piece(f"{hf}mlp.experts.{field.split('.')[2]}_proj", 0, experts)]
        if field == "mlp.experts.gate_up.weight":
            return [
                piece
                for e in range(experts)
                for piece in (
                    Piece(hf + self.GATE.format(e=e), 0, ffn, e),
                    Piece(hf + self.UP.format(e=e), ffn, 2 * ffn, e),
                )
            ]
        if field == "mlp.experts.down.weight":
            return [Piece(hf + self.DOWN.format(e=e), 0, args.hidden_size, e) for e in range(experts)]
        raise KeyError(f"{self.ARCHITECTURE} has no counterpart for layers.*.{field} (shared experts?)")

    def experts_of(self, cfg: dict) -> Any:
        return self.get(cfg, "num_local_experts")

    def top_k_problems(self, cfg: dict) -> list[str]:
        experts, top_k = self.experts_of(cfg), self.get(cfg, "num_experts_per_tok")
        if not _count(experts):
            return [f"{experts!r} experts per layer: nanotrain imports a model with experts"]
        if not _count(top_k) or top_k > experts:
            return [f"num_experts_per_tok {top_k!r}: transformers needs 1 to the {experts} experts"]
        return []

    def moe_inexpressible(self, args: ModelArgs) -> list[str]:
        if args.moe is None:
            return [f"model.moe is absent: {self.ARCHITECTURE} is a mixture of experts"]
        if args.moe.num_shared_experts:
            return [f"model.moe.num_shared_experts {args.moe.num_shared_experts}: {self.ARCHITECTURE} has none"]
        return []


class MixtralMapping(ExpertMapping):
    ARCHITECTURE = "MixtralForCausalLM"
    MODEL_TYPE = "mixtral"
    DEFAULTS = {
        **Mapping.DEFAULTS,
        "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 4096 * 32,
        "num_key_value_heads": 8,
        "sliding_window": None,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
        "router_aux_loss_coef": 0.001,
        "router_jitter_noise": 0.0,
    }
    BIAS_KEYS = ()
    ROUTER = "block_sparse_moe.gate.weight"
    GATE = "block_sparse_moe.experts.{e}.w1.weight"
    UP = "block_sparse_moe.experts.{e}.w3.weight"
    DOWN = "block_sparse_moe.experts.{e}.w2.weight"

    def family_problems(self, cfg: dict) -> list[str]:
        jitter = self.get(cfg, "router_jitter_noise")
        out = self.top_k_problems(cfg)
        if jitter not in (0, 0.0, None):
            out.append(
                f"router_jitter_noise {jitter!r}: Mixtral then scales the router input by random noise in "
                "training; nanotrain's router has none (set it to 0.0)"
            )
        return out

    def moe_section(self, cfg: dict) -> dict[str, Any]:
        return {
            "num_experts": self.experts_of(cfg),
            "top_k": self.get(cfg, "num_experts_per_tok"),
            "expert_intermediate_size": cfg.get("intermediate_size"),
            "layer_frequency": 1,
            "first_dense_layers": 0,
            "aux_loss_coef": float(self.get(cfg, "router_aux_loss_coef")),
            "norm_topk_prob": True,
        }

    def moe_inexpressible(self, args: ModelArgs) -> list[str]:
        out = super().moe_inexpressible(args)
        if args.moe is None:
            return out
        dense = [i for i in range(args.num_layers) if not llama_arch.is_moe_layer(args, i)]
        if dense:
            out.append(f"layers {dense} are dense: every layer of MixtralForCausalLM is MoE")
        if not args.moe.norm_topk_prob:
            out.append("model.moe.norm_topk_prob is false: Mixtral always renormalises the top-k router weights")
        return out

    def family_config(self, args: ModelArgs) -> dict[str, Any]:
        moe = args.moe
        return {
            "intermediate_size": llama_arch.expert_ffn(args),
            "sliding_window": args.sliding_window,
            "num_local_experts": moe.num_experts,
            "num_experts_per_tok": moe.top_k,
            "router_aux_loss_coef": moe.aux_loss_coef,
            "router_jitter_noise": 0.0,
            "output_router_logits": False,
        }


class Qwen3MoeMapping(ExpertMapping):
    ARCHITECTURE = "Qwen3MoeForCausalLM"
    MODEL_TYPE = "qwen3_moe"
    DEFAULTS = {
        **Mapping.DEFAULTS,
        "max_position_embeddings": 32768,
        "num_key_value_heads": 4,
        "use_sliding_window": False,
        "sliding_window": 4096,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "moe_intermediate_size": 768,
        "num_experts_per_tok": 8,
        "num_experts": 128,
        "norm_topk_prob": False,
        "router_aux_loss_coef": 0.001,
    }
    QK_NORM = True
    BIAS_KEYS = ("attention_bias",)
    GATE = "mlp.experts.{e}.gate_proj.weight"
    UP = "mlp.experts.{e}.up_proj.weight"
    DOWN = "mlp.experts.{e}.down_proj.weight"

    def experts_of(self, cfg: dict) -> Any:
        return cfg.get("num_local_experts", self.get(cfg, "num_experts"))

    def sliding_layers(self, cfg: dict) -> tuple[Any, list[bool]]:
        """transformers 5.x: one window for every layer when switched on (``max_window_layers``
        is not read)."""
        if not self.get(cfg, "use_sliding_window"):
            return None, []
        return self.get(cfg, "sliding_window"), [True] * num_layers(cfg)

    def sparse_layers(self, cfg: dict) -> list[int]:
        step, dense = self.get(cfg, "decoder_sparse_step"), self.get(cfg, "mlp_only_layers") or []
        if not _count(step) or not isinstance(dense, list):
            return []
        return [i for i in range(num_layers(cfg)) if i not in dense and (i + 1) % step == 0]

    def layer_pattern(self, cfg: dict) -> tuple[int, int] | None:
        """(first_dense_layers, layer_frequency) whose MoE layers are config.json's sparse ones."""
        sparse, n = self.sparse_layers(cfg), num_layers(cfg)
        if not sparse:
            return None
        first = sparse[0]
        steps = [self.get(cfg, "decoder_sparse_step")] + ([sparse[1] - first] if len(sparse) > 1 else [n - first])
        for k in steps:
            if _count(k) and list(range(first, n, k)) == sparse:
                return first, k
        return None

    def family_problems(self, cfg: dict) -> list[str]:
        out = self.top_k_problems(cfg)
        both = (cfg.get("num_experts"), cfg.get("num_local_experts"))
        if None not in both and both[0] != both[1]:
            out.append(
                f"num_experts {both[0]} but num_local_experts {both[1]}: transformers 4.x reads the first, "
                "5.x the second; keep one"
            )
        if out or self.layer_pattern(cfg) is not None:
            return out
        step, dense = self.get(cfg, "decoder_sparse_step"), self.get(cfg, "mlp_only_layers")
        sparse = self.sparse_layers(cfg)
        return out + [
            f"decoder_sparse_step {step!r} with mlp_only_layers {dense!r} makes layers {sparse} sparse: "
            + (
                "nanotrain's MoE layers are every model.moe.layer_frequency-th from model.moe.first_dense_layers, "
                "which cannot give that"
                if sparse
                else "no layer has experts (import it as qwen3)"
            )
        ]

    def moe_section(self, cfg: dict) -> dict[str, Any]:
        first, every = self.layer_pattern(cfg) or (0, 1)
        return {
            "num_experts": self.experts_of(cfg),
            "top_k": self.get(cfg, "num_experts_per_tok"),
            "expert_intermediate_size": self.get(cfg, "moe_intermediate_size"),
            "layer_frequency": every,
            "first_dense_layers": first,
            "aux_loss_coef": float(self.get(cfg, "router_aux_loss_coef")),
            "norm_topk_prob": bool(self.get(cfg, "norm_topk_prob")),
        }

    def family_config(self, args: ModelArgs) -> dict[str, Any]:
        moe, n = args.moe, args.num_layers
        first, every = moe.first_dense_layers, moe.layer_frequency
        if first == every - 1:  # layers every-1, 2*every-1, ...: (i + 1) % every == 0
            step, dense = every, []
        else:
            step, dense = 1, [i for i in range(n) if not llama_arch.is_moe_layer(args, i)]
        return {
            "attention_bias": False,
            **window_config(args, layer_types=False),
            "num_experts": moe.num_experts,
            "num_local_experts": moe.num_experts,
            "num_experts_per_tok": moe.top_k,
            "moe_intermediate_size": llama_arch.expert_ffn(args),
            "decoder_sparse_step": step,
            "mlp_only_layers": dense,
            "norm_topk_prob": moe.norm_topk_prob,
            "router_aux_loss_coef": moe.aux_loss_coef,
            "output_router_logits": False,
        }


MIXTRAL = MixtralMapping()
QWEN3_MOE = Qwen3MoeMapping()
