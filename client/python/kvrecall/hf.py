"""A Hugging Face transformers attention backend, "kvrecall", that sends every layer's decode
attention to the kvrecall service.

    import kvrecall.hf
    backend = kvrecall.hf.KvRecallBackend(kvrecall.Client(addr), kvrecall.make_policy("retopk"))
    model.set_attn_implementation("kvrecall")   # or from_pretrained(..., attn_implementation="kvrecall")
    with backend:                                # one service session per batch row
        out = model(prompt_ids, past_key_values=DynamicCache(), use_cache=True)   # prefill
        out = model(next_ids, past_key_values=out.past_key_values, use_cache=True)  # decode

Prefill (the first call that reaches a layer): the runner computes its own attention with
PyTorch's SDPA and uploads the layer's keys and values, with the post-RoPE queries the session
needs (CreateSessionResponse.prompt_queries). Every later call is a
decode call: each new token's query, key and value go to the service over the client's one
Decode stream, the batch rows of a layer travelling in one request, and the service's output
replaces local attention. Tensors the attention function sees are query [B, q_heads, n, D] and
key/value [B, kv_heads, S, D] (the model's own cache appended; only the last n positions are
read); it returns [B, n, q_heads, D]. Batches must not be padded (the service attends over
every position it holds, so it cannot honour a pad mask): rows have equal lengths, and a call
whose attention_mask hides (or biases) a position a query would see raises ValueError. One
backend holds one generation: a decode call whose cache length is not the service's (a second
prompt with a fresh DynamicCache in the same `with backend:`) raises ValueError too; leave the
block, or call close_sessions(), to start another.
"""
import contextvars
import math

import numpy as np
import torch

from kvrecall.client import make_geometry

_ACTIVE = contextvars.ContextVar("kvrecall_backend", default=None)
_TORCH_DTYPES = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}
NAME = "kvrecall"


class KvRecallBackend:
    """The sessions of one batch of sequences. Enter it around the forward calls of one
    generation; leaving it closes the sessions."""

    def __init__(self, client, policy=None, label="transformers", max_tokens=0):
        """max_tokens: the most tokens a generation holds (its prompt and new tokens), when the
        caller knows it: each session sets their memory aside at creation, so that its KV never
        grows mid-generation (a growth copies and pins every layer's KV at one token). 0: not
        announced."""
        self.client = client
        self.policy = policy
        self.label = label
        self.max_tokens = max_tokens
        self.sessions = None
        self._prefilled = set()
        self._tokens = {}  # layer: tokens the sessions hold in it (every row the same)
        self._token = None

    def __enter__(self):
        if self._token is not None:
            raise RuntimeError("KvRecallBackend is already active")
        self._token = _ACTIVE.set(self)
        return self

    def __exit__(self, exc_type, exc, tb):
        _ACTIVE.reset(self._token)
        self._token = None
        try:
            self.close_sessions()
        except Exception as e:
            if exc is None:
                raise
            # The body's exception is the one to see: a failed close goes with it as a note
            # instead of replacing it.
            if hasattr(exc, "add_note"):
                exc.add_note(f"closing the kvrecall sessions failed too: {e}")

    def close_sessions(self):
        """Closes every session, even after one close fails (each holds server memory until
        closed), and forgets them; then raises the first close's error."""
        sessions = self.sessions or []
        self.sessions, self._prefilled, self._tokens = None, set(), {}
        first = None
        for s in sessions:
            try:
                s.close()
            except Exception as e:
                first = first or e
        if first is not None:
            raise first

    def _open(self, module, query, key, scaling):
        layers = module.config.num_hidden_layers
        g = make_geometry(layers, query.shape[1], key.shape[1], query.shape[-1],
                          _TORCH_DTYPES[query.dtype], softmax_scale=float(scaling))
        sessions = []
        try:
            for b in range(query.shape[0]):
                sessions.append(self.client.create_session(g, self.policy,
                                                           f"{self.label} row {b}",
                                                           max_tokens=self.max_tokens))
        except BaseException:
            # The rows made before the failure would otherwise hold server memory until the
            # server restarts: nothing else knows them. The create's error is the one raised.
            for s in sessions:
                try:
                    s.close()
                except Exception:
                    pass
            raise
        self.sessions = sessions

    def attention(self, module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                  **kwargs):
        layer = module.layer_idx
        n, total = query.shape[2], key.shape[2]
        _check_unpadded(attention_mask, layer, n, total)  # before a session is made for nothing
        scaling = scaling if scaling is not None else 1.0 / math.sqrt(query.shape[-1])
        if self.sessions is None:
            self._open(module, query, key, scaling)
        if len(self.sessions) != query.shape[0]:
            raise ValueError(f"batch of {query.shape[0]} rows in a backend holding "
                             f"{len(self.sessions)} sessions")
        if layer not in self._prefilled:
            return self._prefill(module, layer, query, key, value, attention_mask, scaling,
                                 dropout, **kwargs)
        held = self._tokens[layer]
        if total != held + n:
            raise ValueError(f"layer {layer}: the model's cache holds {total - n} tokens before "
                             f"these {n}, the service's sessions {held}; one backend serves one "
                             "generation (leave `with backend:` or call close_sessions() before "
                             "the next)")
        outs = []
        for t in range(n):  # several new tokens: one decode step each, in order (causal)
            # Each token says the position the model's cache gives it: a session out of step
            # refuses the request (ABORTED) before anything of it is applied.
            steps = [(s, query[b, :, t], key[b, :, total - n + t],
                      value[b, :, total - n + t], held + t) for b, s in enumerate(self.sessions)]
            res = self.client.attend_batch(layer, steps)
            self._tokens[layer] = held + t + 1
            outs.append(np.stack([r.output for r in res]))  # [B, q_heads, D]
        out = torch.from_numpy(np.stack(outs, axis=1))       # [B, n, q_heads, D]
        return out.to(device=query.device, dtype=query.dtype), None

    def _prefill(self, module, layer, query, key, value, attention_mask, scaling, dropout,
                 **kwargs):
        if key.shape[2] != query.shape[2]:
            raise ValueError(f"layer {layer}: the first call must be the whole prompt "
                             f"({query.shape[2]} queries, {key.shape[2]} keys)")
        from transformers.integrations.sdpa_attention import sdpa_attention_forward
        out = sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                     scaling=scaling, **kwargs)
        for b, s in enumerate(self.sessions):
            s.prefill({layer: (query[b].transpose(0, 1), key[b].transpose(0, 1),
                               value[b].transpose(0, 1))})
        self._prefilled.add(layer)
        self._tokens[layer] = key.shape[2]
        return out


def _check_unpadded(attention_mask, layer, n, total):
    """ValueError unless attention_mask lets each of the n queries (the last n of `total`
    positions) see every position up to its own, unbiased: the service attends over all the
    positions it holds, so a pad (or any bias) the mask applies would be silently ignored.
    None (SDPA's mask where nothing is hidden) passes; a boolean mask is True where seen, a
    float one 0 there (additive)."""
    if attention_mask is None:
        return
    # Keys beyond `total` are cut off as sdpa_attention_forward cuts them (transformers before
    # 4.53 make a DynamicCache's mask one position longer than its keys).
    m = attention_mask[..., :total]
    if m.dim() != 4 or m.shape[-1] != total or m.shape[-2] not in (1, n):
        raise ValueError(f"layer {layer}: attention_mask of shape {list(m.shape)} is not "
                         f"[batch, heads, {n} queries, {total} keys]")
    if m.dtype == torch.bool:
        seen = m
    elif m.is_floating_point():
        seen = m == 0
    else:
        raise ValueError(f"layer {layer}: attention_mask of dtype {m.dtype} is neither boolean "
                         "nor an additive float mask")
    positions = torch.arange(total, device=m.device)
    causal = positions[None, :] <= positions[total - n:, None]  # [n, total]: what each sees
    hidden = (causal & ~seen).nonzero()
    if len(hidden):
        row, _, query_index, position = (int(i) for i in hidden[0])
        raise ValueError(f"layer {layer}: attention_mask hides or biases position {position} "
                         f"from query {total - n + query_index} of batch row {row}; the kvrecall "
                         "backend takes unpadded batches only, with plain causal attention (the "
                         "service attends over every position it holds: no padding, sliding "
                         "window or other mask)")


def attention_forward(module, query, key, value, attention_mask, **kwargs):
    """The function registered as "kvrecall": forwards to the active KvRecallBackend."""
    backend = _ACTIVE.get()
    if backend is None:
        raise RuntimeError('attn_implementation="kvrecall" needs an active KvRecallBackend '
                           "(use `with backend:` around the forward calls)")
    return backend.attention(module, query, key, value, attention_mask, **kwargs)


def register():
    from transformers import AttentionInterface
    AttentionInterface.register(NAME, attention_forward)
    try:
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    except ImportError:  # older transformers build a 4-D float mask for an unknown name
        return
    # From transformers 4.53 on, an implementation without a mask function of its own gets no
    # mask at all, so a padded batch could not be noticed. SDPA's (None where nothing is
    # hidden, a boolean mask where something is) is what _prefill's sdpa_attention_forward
    # takes anyway.
    ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])


register()


def tinylm_to_llama(npz_path, attn_implementation="sdpa"):
    """A transformers LlamaForCausalLM holding tinylm weights (vocab 256, RMSNorm eps 1e-6,
    rope theta from the .npz config, untied head), float32, on the CPU."""
    import inspect
    from transformers import LlamaConfig, LlamaForCausalLM
    from kvrecall.tinylm import TinyLM
    m = TinyLM(npz_path)
    c = m.config
    kw = dict(vocab_size=256, hidden_size=c["d_model"], intermediate_size=c["ff"],
              num_hidden_layers=c["layers"], num_attention_heads=c["q_heads"],
              num_key_value_heads=c["kv_heads"], head_dim=c["head_dim"], hidden_act="silu",
              max_position_embeddings=1 << 20, rms_norm_eps=1e-6, tie_word_embeddings=False,
              attention_bias=False, mlp_bias=False)
    if "rope_parameters" in inspect.signature(LlamaConfig.__init__).parameters:
        kw["rope_parameters"] = {"rope_type": "default", "rope_theta": c["rope_base"]}
    else:
        kw["rope_theta"] = c["rope_base"]
    config = LlamaConfig(**kw)
    config._attn_implementation = attn_implementation
    model = LlamaForCausalLM(config).float().eval()
    names = {"model.embed_tokens.weight": "emb.weight", "model.norm.weight": "norm.w",
             "lm_head.weight": "head.weight"}
    for i in range(c["layers"]):
        src, dst = f"blocks.{i}.", f"model.layers.{i}."
        for a, b in (("q", "self_attn.q_proj"), ("k", "self_attn.k_proj"),
                     ("v", "self_attn.v_proj"), ("o", "self_attn.o_proj"),
                     ("w1", "mlp.gate_proj"), ("w3", "mlp.up_proj"), ("w2", "mlp.down_proj")):
            names[f"{dst}{b}.weight"] = f"{src}{a}.weight"
        names[f"{dst}input_layernorm.weight"] = src + "n1.w"
        names[f"{dst}post_attention_layernorm.weight"] = src + "n2.w"
    state = {k: torch.from_numpy(m.w[v]) for k, v in names.items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if "rotary" not in k]
    if missing or unexpected:
        raise ValueError(f"tinylm -> Llama: missing {missing}, unexpected {unexpected}")
    return model, m


def set_attn_implementation(model, name):
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(name)
    else:
        model.config._attn_implementation = name


@torch.no_grad()
def greedy(model, prompt_ids, new_tokens):
    """Greedy generation with the model's own cache; returns the [B, new_tokens] new ids."""
    from transformers import DynamicCache
    out = model(input_ids=prompt_ids, past_key_values=DynamicCache(), use_cache=True)
    ids = []
    for _ in range(new_tokens):
        nxt = out.logits[:, -1].argmax(-1, keepdim=True)
        ids.append(nxt)
        out = model(input_ids=nxt, past_key_values=out.past_key_values, use_cache=True)
    return torch.cat(ids, dim=1)
