"""Training a DeepSeekModel: losses, the aux-loss-free router-bias update, and a jitted optax step.

Dimension letters: B batch, T tokens, V vocab, E routed experts, K experts per token,
N = number of MoE layers seen by the loss (main MoE layers in order, then the MTP blocks').

Loss (DEEPSEEK_SEMANTICS.md §2.4, §3.1):
  ce       next-token cross-entropy over valid (input, target) pairs
  mtp      λ/D Σ_k CE of MTP depth k (position i predicts token i+2+k)
  balance  α Σ_layers mean_sequences Σ_i f_i P_i, with f_i = E/(K·T_b) Σ_t 1[i ∈ TopK_t] and
           P_i = (1/T_b) Σ_t s'_{i,t}, s' the affinities normalised over experts (sigmoid for V3)
  loss     ce + mtp + balance
The router bias is not trained: after the optimizer update, `router_bias_update` applies
b += γ·sign(mean(load) − load) per MoE layer, with load the tokens routed to each expert over
the whole batch (padding excluded). It never passes through the optimizer.

State layout (flax 0.12, functional): `graphdef, state = nnx.split(model)`; `state` holds every
variable (Params and RouterBias). The step splits it into Params (differentiated, updated by
optax) and the rest (RouterBias, updated by the rule above), so the optimizer cannot touch the
bias by construction. `opt_state = tx.init(params)` (see `init_train_state`).

Memory (TrainConfig): `ce_chunk` computes the LM-head cross-entropy (main head and MTP heads)
`ce_chunk` tokens at a time under `jax.checkpoint`, so the fp32 [B·T, V] logits never exist whole:
forward and backward hold one [ce_chunk, V] block (the backward recomputes each block's logits).
`remat` is the scanned layers' rematerialisation policy (`models.deepseek.REMAT_POLICIES`). The
jitted step donates the state and the optimizer state: their buffers become the updated ones (a
caller must not read the arrays it passed in after the call).

On a mesh: a model placed by `mla_jax.sharding.shard_model` (`fsdp=True` for FSDP) and a batch by
`shard_batch`; `init_train_state` puts the optimizer state beside the parameters it tracks, and
`make_train_step(..., shardings=...)` returns both as they came. GSPMD partitions the rest.

Mixed precision: this module keeps whatever dtypes the model and the optimizer were built with; it
casts nothing. What `models.training.loop` (mla-train) builds: fp32 parameters (the master copy the
optimizer updates), compute in `TrainSettings.dtype` (bf16: each layer casts its fp32 weights to
bf16 at use; RMSNorm, RoPE, softmax statistics, the router and the loss stay fp32), gradients in fp32
(the parameters' dtype), AdamW moments in fp32 (optax keeps them in the parameters' dtype). A model
built with bf16 parameters (`mla-bench train --param-dtype bf16`, as the V2-Lite measurements of
the training-at-scale issue) has bf16 gradients and bf16 AdamW moments.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from mla_jax.attention import DECOMPRESSED_IMPLS
from models.deepseek import REMAT_POLICIES, DeepSeekModel, ModelOutput
from models.moe import RouterOutput

_F32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Loss weights and the bias update rate (V3 values by default)."""

    mtp_weight: float = 0.3  # λ (0.3 for the first 10T tokens of V3, then 0.1)
    balance_alpha: float = 1e-4  # α of the sequence-wise balance loss
    bias_update_rate: float = 1e-3  # γ (0 for V3's last 500B tokens)
    absorbed: bool = False  # MLA path used in training (the naive one is the compute-friendly one)
    remat: str = "none"  # rematerialisation of each scanned layer (models.deepseek.REMAT_POLICIES)
    ce_chunk: int = 0  # tokens per LM-head cross-entropy chunk (0: the whole [B·T, V] logits at once)
    attn_q_block: int = 0  # queries per block of the decompressed attention (0: all T at once)
    attn_impl: str = (
        "xla"  # the decompressed attention: "xla" (jnp), "cudnn" or "mgpu" (flash; GPU, right padding only)
    )

    def __post_init__(self):
        for f in ("mtp_weight", "balance_alpha", "bias_update_rate"):
            if getattr(self, f) < 0:
                raise ValueError(f"TrainConfig.{f}={getattr(self, f)!r}: must be >= 0")
        if self.remat not in REMAT_POLICIES:
            raise ValueError(f"TrainConfig.remat={self.remat!r}: must be one of {REMAT_POLICIES}")
        if not isinstance(self.ce_chunk, int) or self.ce_chunk < 0:
            raise ValueError(f"TrainConfig.ce_chunk={self.ce_chunk!r}: must be an integer >= 0 (0 = unchunked)")
        if not isinstance(self.attn_q_block, int) or self.attn_q_block < 0:
            raise ValueError(f"TrainConfig.attn_q_block={self.attn_q_block!r}: must be an integer >= 0 (0 = whole)")
        if self.attn_impl not in DECOMPRESSED_IMPLS[1:]:  # resolved: "auto" is the caller's to resolve
            raise ValueError(f"TrainConfig.attn_impl={self.attn_impl!r}: must be one of {DECOMPRESSED_IMPLS[1:]}")


# ------------------------------------------------------------------------------------------
# Pieces
# ------------------------------------------------------------------------------------------
def positions_from_mask(mask_BT: jax.Array) -> jax.Array:
    """int32 [B,T]: 0, 1, ... over the valid tokens of each row, −1 on padding (MLA ignores negative positions).

    Works for left and right padding.
    """
    m = mask_BT.astype(jnp.int32)
    return jnp.where(m > 0, jnp.cumsum(m, axis=1) - 1, -1).astype(jnp.int32)


def masked_cross_entropy(logits_BTV: jax.Array, targets_BT: jax.Array, mask_BT: jax.Array) -> jax.Array:
    """Mean token NLL over mask (fp32); 0 when nothing is valid."""
    nll = optax.softmax_cross_entropy_with_integer_labels(logits_BTV.astype(_F32), targets_BT)
    m = mask_BT.astype(_F32)
    return jnp.sum(nll * m) / jnp.maximum(jnp.sum(m), 1.0)


def chunked_cross_entropy(
    head, h_BTD: jax.Array, targets_BT: jax.Array, mask_BT: jax.Array, chunk: int, weights=()
) -> jax.Array:
    """`masked_cross_entropy(head(weights, h), targets, mask)` without the whole [B·T, V] logits.

    head(weights, h_CD) -> logits [C, V] (the LM head with its weights passed in, see `lm_head_fn`);
    h [B,T,D] the hidden it reads; `weights` any pytree. The B·T tokens are cut into blocks of `chunk`
    (the last padded with weight 0) and a `jax.lax.scan` over the blocks adds up each block's weighted
    NLL under `jax.checkpoint`: the forward keeps no logits and the backward recomputes one block's at
    a time. fp32 like `masked_cross_entropy`; equal to it up to the order of the fp32 sum. The weights'
    gradient is summed over the blocks in their own dtype: pass fp32 copies (as `lm_head_fn` does) to
    sum it in fp32 and round once, as the unchunked matmul does.
    """
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1 token, got {chunk}")
    D = h_BTD.shape[-1]
    h_ND = h_BTD.reshape(-1, D)
    t_N = targets_BT.reshape(-1)
    m_N = mask_BT.reshape(-1).astype(_F32)
    n = h_ND.shape[0]
    c = min(chunk, n)
    pad = -n % c
    if pad:  # padded tokens: hidden 0 (finite logits), target 0, weight 0
        h_ND, t_N, m_N = jnp.pad(h_ND, ((0, pad), (0, 0))), jnp.pad(t_N, (0, pad)), jnp.pad(m_N, (0, pad))
    k = (n + pad) // c

    @jax.checkpoint
    def block_nll(w, h_CD, t_C, m_C):
        nll = optax.softmax_cross_entropy_with_integer_labels(head(w, h_CD).astype(_F32), t_C)
        return jnp.sum(nll * m_C)

    def body(total, xs):
        return total + block_nll(weights, *xs), None

    total, _ = jax.lax.scan(body, jnp.zeros((), _F32), (h_ND.reshape(k, c, D), t_N.reshape(k, c), m_N.reshape(k, c)))
    return total / jnp.maximum(jnp.sum(m_N), 1.0)


def lm_head_fn(model: DeepSeekModel):
    """(head, weights) for `chunked_cross_entropy`: `head(weights, h)` is `model.logits_from_hidden(h)` with
    the LM head's variables (lm_head, or the embedding when tied) taken from `weights`, fp32 copies of
    them; each is cast back to its own dtype at use, so the logits are the model's, bit for bit."""
    name = "embed_tokens" if model.lm_head is None else "lm_head"
    graphdef, w, rest = nnx.split(model, nnx.PathContains(name), ...)

    def head(w32, h):
        return nnx.merge(graphdef, jax.tree.map(lambda a, ref: a.astype(ref.dtype), w32, w), rest).logits_from_hidden(h)

    return head, jax.tree.map(lambda a: a.astype(_F32), w)


def _router_masks(out: ModelOutput, mask_BT: jax.Array, n_main_moe: int) -> list[jax.Array]:
    """The [B, T_r] validity mask of each router's tokens (MTP depth k sees positions 0..T-2-k)."""
    T = mask_BT.shape[1]
    masks = [mask_BT] * n_main_moe
    for k in range(len(out.routers) - n_main_moe):
        n = T - 1 - k
        masks.append(mask_BT[:, :n] * mask_BT[:, 1 + k :])
    return masks


def expert_load(router: RouterOutput, mask_BT: jax.Array, num_experts: int) -> jax.Array:
    """fp32 [E]: how many valid (token, expert) assignments each expert received."""
    m = mask_BT.reshape(-1).astype(_F32)
    onehot = jax.nn.one_hot(router.indices, num_experts, dtype=_F32)  # [B·T, K, E]
    return jnp.einsum("t,tke->e", m, onehot)


def sequence_balance_loss(router: RouterOutput, mask_BT: jax.Array, num_experts: int, top_k: int) -> jax.Array:
    """Σ_i f_i P_i averaged over the sequences (without α). Gradient flows through P only."""
    B, T = mask_BT.shape
    m = mask_BT.astype(_F32)
    count_BE = jnp.einsum("bt,btke->be", m, jax.nn.one_hot(router.indices.reshape(B, T, -1), num_experts, dtype=_F32))
    t_b = jnp.maximum(jnp.sum(m, axis=1, keepdims=True), 1.0)  # [B, 1] valid tokens per sequence
    f_BE = jax.lax.stop_gradient(count_BE * num_experts / (top_k * t_b))
    s = router.scores.reshape(B, T, num_experts).astype(_F32)
    s_norm = s / jnp.sum(s, axis=-1, keepdims=True)  # normalised affinities s'
    p_BE = jnp.einsum("bt,bte->be", m, s_norm) / t_b
    has_tokens = (jnp.sum(m, axis=1) > 0).astype(_F32)
    per_seq = jnp.sum(f_BE * p_BE, axis=-1) * has_tokens
    return jnp.sum(per_seq) / jnp.maximum(jnp.sum(has_tokens), 1.0)


def moe_modules(model: DeepSeekModel) -> list:
    """The MoE modules in the order of `ModelOutput.routers`: the stack of main MoE layers (one
    module whose variables have a leading layer axis, `cfg.num_moe_layers` routers), then the MTP
    blocks' (one router each)."""
    mods = [] if model.moe_layers is None else [model.moe_layers.mlp]
    mods += [m.block.mlp for m in model.mtp if m.block.is_moe]
    return mods


def router_bias_update(model: DeepSeekModel, loads_NE: jax.Array, gamma: float) -> None:
    """In place: b += γ·sign(mean(load) − load) for each MoE layer with a correction bias (fp32).

    `loads_NE` [N, E] in the order of `ModelOutput.routers` (main MoE layers, then the MTP blocks';
    rows beyond the MoE layers the loss saw are absent: those biases are left alone). Overloaded
    experts go down, underloaded up.
    """
    row = 0
    for mod in moe_modules(model):
        bias = mod.gate.e_score_correction_bias
        n = bias.shape[0] if bias is not None and bias.ndim == 2 else 1  # a stack holds n routers
        load = loads_NE[row : row + n].astype(_F32)
        row += n
        if bias is None or load.shape[0] < n:
            continue
        step = jnp.float32(gamma) * jnp.sign(jnp.mean(load, axis=-1, keepdims=True) - load)
        bias[...] = bias[...] + (step if bias.ndim == 2 else step[0])


def loss_fn(model: DeepSeekModel, batch: dict[str, jax.Array], tc: TrainConfig = TrainConfig()):
    """-> (loss, metrics). batch: `input_ids` int32 [B,T]; optional `attention_mask` [B,T] (1 = real token,
    0 = padding, left or right: padding is invisible to attention, losses and loads); optional
    `loss_mask` [B,T] (1 = this token is a training target, e.g. 0 on a prompt; default: attention_mask).

    metrics: loss, ce, mtp_loss, balance_loss (all scalars, with their weights applied) and
    expert_load fp32 [N, E] (valid assignments per expert, per MoE layer).
    """
    ids = batch["input_ids"]
    if ids.ndim != 2 or ids.shape[1] < 2:
        raise ValueError(f"input_ids must be [B, T] with T >= 2, got {ids.shape}")
    mask = batch.get("attention_mask")
    mask = jnp.ones(ids.shape, _F32) if mask is None else mask.astype(_F32)
    positions = positions_from_mask(mask)
    target = batch.get("loss_mask")
    target = mask if target is None else target.astype(_F32) * mask
    cfg = model.cfg
    use_mtp = tc.mtp_weight > 0 and len(model.mtp) > 0
    chunked = tc.ce_chunk > 0
    out = model.forward(
        ids,
        positions,
        absorbed=tc.absorbed,
        with_mtp=use_mtp,
        head=not chunked,
        remat=tc.remat,
        q_block=tc.attn_q_block or None,
        attn_impl=tc.attn_impl,
    )
    if chunked:
        head, head_weights = lm_head_fn(model)

    def ce_of(x_BTX, targets, valid):
        """CE on the first targets.shape[1] positions of `x`: the head's input [B,T,D] when chunked, else its
        logits [B,T,V]."""
        x_BTX = x_BTX[:, : targets.shape[1]]
        if chunked:
            return chunked_cross_entropy(head, x_BTX, targets, valid, tc.ce_chunk, head_weights)
        return masked_cross_entropy(x_BTX, targets, valid)

    T = ids.shape[1]
    ce = ce_of(out.hidden if chunked else out.logits, ids[:, 1:], mask[:, :-1] * target[:, 1:])
    mtp = jnp.zeros((), _F32)
    for k, x in enumerate(out.mtp_hidden if chunked else out.mtp_logits):
        n = T - 2 - k  # positions whose target token i+2+k exists
        if n < 1:
            continue
        valid = mask[:, :n] * mask[:, 1 + k : T - 1] * target[:, 2 + k :]
        mtp = mtp + ce_of(x, ids[:, 2 + k :], valid)
    mtp = tc.mtp_weight * mtp / max(len(model.mtp), 1)
    n_main = cfg.num_moe_layers
    masks = _router_masks(out, mask, n_main)
    E, K = cfg.n_routed_experts, cfg.num_experts_per_tok
    bal = jnp.zeros((), _F32)
    loads = []
    for r, m in zip(out.routers, masks):
        bal = bal + sequence_balance_loss(r, m, E, K)
        loads.append(expert_load(r, m, E))
    bal = tc.balance_alpha * bal
    loss = ce + mtp + bal
    load_NE = jnp.stack(loads) if loads else jnp.zeros((0, max(E, 1)), _F32)
    metrics = dict(loss=loss, ce=ce, mtp_loss=mtp, balance_loss=bal, expert_load=jax.lax.stop_gradient(load_NE))
    return loss, metrics


# ------------------------------------------------------------------------------------------
# The step
# ------------------------------------------------------------------------------------------
def optimizer_shardings(tx: optax.GradientTransformation, params, param_shardings):
    """The shardings of `tx.init(params)` for Params placed by `param_shardings` (an nnx.State of
    NamedShardings of the Params' structure; `params` may be abstract): each moment as its parameter,
    everything else (the step counts) replicated on the same mesh."""
    mesh = jax.tree.leaves(param_shardings)[0].mesh
    return optax.tree_map_params(
        tx,
        lambda _, sharding: sharding,
        jax.eval_shape(tx.init, params),
        param_shardings,
        transform_non_params=lambda _: NamedSharding(mesh, PartitionSpec()),
    )


def init_train_state(model: DeepSeekModel, tx: optax.GradientTransformation):
    """-> (graphdef, state, opt_state): the functional form of `model` and the optimizer state over its Params.

    For a model placed on a mesh (`mla_jax.sharding.shard_model`) the optimizer state is created there,
    each moment sharded as its parameter (`optimizer_shardings`): under `fsdp=True` the AdamW moments are
    sharded over `data` with the weights."""
    graphdef, state = nnx.split(model)
    params = nnx.split_state(state, nnx.Param, ...)[0]
    leaves = jax.tree.leaves(params)
    if leaves and isinstance(leaves[0].sharding, NamedSharding):
        shardings = optimizer_shardings(tx, params, jax.tree.map(lambda x: x.sharding, params))
        return graphdef, state, jax.jit(tx.init, out_shardings=shardings)(params)
    return graphdef, state, tx.init(params)


def make_train_step(
    tx: optax.GradientTransformation, tc: TrainConfig = TrainConfig(), *, donate: bool = True, shardings=None
):
    """A jitted `train_step(graphdef, state, opt_state, batch) -> (state, opt_state, metrics)`.

    `state` and `opt_state` are donated (unless `donate=False`, for profilers that call it again on the same
    arrays): the step writes the new ones into their buffers, so the arrays passed in are deleted by the call
    (keep only what it returns). One optax update of the Params on
    `loss_fn`'s gradient, then the router-bias rule with the step's expert loads (outside the gradient).
    metrics: `loss_fn`'s plus `grad_norm`.

    `shardings` (on a mesh): (the state's, the optimizer state's) NamedShardings, e.g.
    `jax.tree.map(lambda x: x.sharding, (state, opt_state))` of `init_train_state`'s: the step returns
    both placed so, whatever GSPMD would choose (the layout holds across steps, and every donated
    buffer is reused), and the metrics replicated on the mesh (readable on every host).
    """

    def train_step(graphdef, state, opt_state, batch):
        params, rest = nnx.split_state(state, nnx.Param, ...)

        def f(p):
            return loss_fn(nnx.merge(graphdef, p, rest), batch, tc)

        (_, metrics), grads = jax.value_and_grad(f, has_aux=True)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        model = nnx.merge(graphdef, params, rest)
        if tc.bias_update_rate > 0:
            router_bias_update(model, metrics["expert_load"], tc.bias_update_rate)
        metrics["grad_norm"] = optax.tree.norm(grads)
        return nnx.state(model), opt_state, metrics

    placed = {}
    if shardings is not None:
        state_sh, opt_sh = shardings
        placed["out_shardings"] = (state_sh, opt_sh, NamedSharding(jax.tree.leaves(state_sh)[0].mesh, PartitionSpec()))
    return jax.jit(train_step, static_argnums=(0,), donate_argnums=(1, 2) if donate else (), **placed)
