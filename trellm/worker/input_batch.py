"""The runner's persistent copy of each request and the flat batch built per step."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from trellm.attention.kv_mirror import DecodeKVMirror
from trellm.attention.torch_paged import AttentionMetadata, DecodeGroup, PrefillSeq, decode_mask
from trellm.engine.request import token_slice
from trellm.engine.types import StepPlan
from trellm.host_copy import device_tensor
from trellm.sampling_params import SamplingParams


@dataclass
class CachedRequestState:
    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    generator: torch.Generator | None
    pending: tuple[torch.Tensor, int] | None = None
    """Async scheduling: the last sampled token is still on the device, as row
    ``pending[1]`` of ``pending[0]``; it counts in ``num_tokens`` already."""

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids) + (self.pending is not None)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids) + (self.pending is not None)

    def token_slice(self, start: int, end: int) -> list[int]:
        return token_slice(self.prompt_token_ids, self.output_token_ids, start, end)


@dataclass
class PromptLogprobSpan:
    state: CachedRequestState
    rows: range
    """Rows of the selected-logits tensor for this request's prompt positions."""
    target_ids: list[int]
    first_chunk: bool


@dataclass
class BatchInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logits_index: torch.Tensor
    """Rows of the hidden states to run through the LM head."""
    samplers: list[tuple[CachedRequestState, int]] = field(default_factory=list)
    """(request, row in the selected logits) for requests that sample this step."""
    prompt_spans: list[PromptLogprobSpan] = field(default_factory=list)


def _fill_pending(ids: torch.Tensor, pending: list[tuple[int, torch.Tensor, int]]) -> None:
    """Write tokens sampled last step, still on the device, into the flat input ids."""
    src = pending[0][1]
    if any(p[1] is not src for p in pending):
        raise RuntimeError("pending tokens from more than one step")
    dst = device_tensor([p[0] for p in pending], ids.device)
    rows = device_tensor([p[2] for p in pending], src.device)
    ids.index_copy_(0, dst, src.index_select(0, rows))


def build_batch(plan: StepPlan, states: dict[str, CachedRequestState], block_size: int,
                device: torch.device, mirror: DecodeKVMirror | None = None, step: int = 0) -> BatchInputs:
    """Flatten the plan: decode requests (one new token) first so they form one
    contiguous group, then each prefill chunk."""
    order = sorted(plan.num_scheduled_tokens.items(), key=lambda kv: kv[1] != 1)
    ids: list[int] = []
    pos: list[int] = []
    slots: list[int] = []
    dec_rows: list[int] = []
    dec_tables: list[list[int]] = []
    dec_lens: list[int] = []
    dec_ids: list[str] = []
    prefills: list[tuple[int, int, int, list[int]]] = []
    logit_rows: list[int] = []
    samplers: list[tuple[CachedRequestState, int]] = []
    spans: list[PromptLogprobSpan] = []
    pending: list[tuple[int, torch.Tensor, int]] = []
    for rid, n in order:
        st = states[rid]
        start, end = st.num_computed_tokens, st.num_computed_tokens + n
        q_start = len(ids)
        ids.extend(st.token_slice(start, end))
        if st.pending is not None and end == st.num_tokens:
            # The last position is the token in flight: a placeholder, filled on the device.
            pending.append((len(ids), *st.pending))
            ids.append(0)
        pos.extend(range(start, end))
        slots.extend(st.block_ids[p // block_size] * block_size + p % block_size for p in range(start, end))
        if n == 1:
            dec_rows.append(q_start)
            dec_tables.append(st.block_ids)
            dec_lens.append(end)
            dec_ids.append(rid)
        else:
            prefills.append((q_start, n, end, st.block_ids[: (end + block_size - 1) // block_size]))
        if st.params.prompt_logprobs is not None and start < len(st.prompt_token_ids):
            _add_prompt_span(st, start, end, q_start, logit_rows, spans)
        if end == st.num_tokens:
            samplers.append((st, len(logit_rows)))
            logit_rows.append(q_start + n - 1)
    meta = _metadata(slots, dec_rows, dec_tables, dec_lens, prefills, block_size, device)
    if meta.decode is not None and mirror is not None:
        meta.decode.mirror, meta.decode.step = mirror, step
        meta.decode.request_ids, meta.decode.lens = tuple(dec_ids), tuple(dec_lens)
    input_ids = device_tensor(ids, device)
    if pending:
        _fill_pending(input_ids, pending)
    return BatchInputs(
        input_ids=input_ids,
        positions=device_tensor(pos, device),
        meta=meta,
        logits_index=device_tensor(logit_rows, device),
        samplers=samplers,
        prompt_spans=spans,
    )


def _add_prompt_span(st: CachedRequestState, start: int, end: int, q_start: int,
                     logit_rows: list[int], spans: list[PromptLogprobSpan]) -> None:
    # Position i predicts token i+1; only predictions of prompt tokens count.
    last = min(end, len(st.prompt_token_ids) - 1)
    rows_start = len(logit_rows)
    logit_rows.extend(q_start + (i - start) for i in range(start, last))
    spans.append(PromptLogprobSpan(
        state=st, rows=range(rows_start, len(logit_rows)),
        target_ids=st.prompt_token_ids[start + 1:last + 1], first_chunk=start == 0))


def _contiguous_start(tables: list[list[int]], seq_len: int, block_size: int) -> int | None:
    if len(tables) != 1:
        return None
    blocks = tables[0][: (seq_len + block_size - 1) // block_size]
    first = blocks[0]
    return first if blocks == list(range(first, first + len(blocks))) else None


def _metadata(slots, dec_rows, dec_tables, dec_lens, prefills, block_size, device) -> AttentionMetadata:
    decode = None
    if dec_rows:
        width = max(len(t) for t in dec_tables)
        table = torch.zeros(len(dec_tables), width, dtype=torch.long, pin_memory=device.type == "cuda")
        for i, t in enumerate(dec_tables):
            table[i, : len(t)] = torch.tensor(t, dtype=torch.long)
        seq_lens = device_tensor(dec_lens, device)
        padded = min(dec_lens) != max(dec_lens)
        decode = DecodeGroup(
            token_index=device_tensor(dec_rows, device),
            block_table=table.to(device, non_blocking=True),
            seq_lens=seq_lens,
            max_seq_len=max(dec_lens),
            attn_mask=decode_mask(seq_lens, max(dec_lens)) if padded else None,
            contiguous_start=_contiguous_start(dec_tables, dec_lens[0], block_size),
        )
    prefill_seqs = [
        PrefillSeq(q_start=qs, q_len=n, seq_len=end,
                   block_ids=device_tensor(blocks, device))
        for qs, n, end, blocks in prefills
    ]
    return AttentionMetadata(
        slot_mapping=device_tensor(slots, device),
        decode=decode, prefills=prefill_seqs, block_size=block_size)
