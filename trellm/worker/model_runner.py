"""Executes a StepPlan on the model: keeps the runner-side request copies, builds
the flat batch, runs the forward over the paged KV cache, samples."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from trellm.attention.kv_mirror import DecodeKVMirror
from trellm.engine.types import StepPlan, StepResult, TokenLogprobs
from trellm.host_copy import device_tensor
from trellm.worker.input_batch import BatchInputs, CachedRequestState, build_batch
from trellm.worker.sampler import Sampler, SamplingRow, compute_prompt_logprobs, is_device_only, make_generator


@dataclass
class ForwardContext:
    """What attention layers need during one forward."""

    backend: object
    kv_caches: list[torch.Tensor]
    meta: object
    cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None
    """RoPE tables for this step's positions, filled once by the model for all layers."""
    rope_rotation: torch.Tensor | None = None
    """[T, D, D] RoPE as rotation matrices (small CPU steps; see RotaryEmbedding.rotation)."""
    ops: object | None = None
    """trellm.kernels.FusedOps: the model takes its fused path (GPU kernels); None: plain ops."""


@dataclass
class LaunchedStep:
    """A step queued on the device whose sampled tokens are not yet on the host."""

    tokens: torch.Tensor | None
    """Sampled token ids on the device (the next step's inputs read them there)."""
    host_tokens: torch.Tensor | None
    """Filled by a non-blocking copy; valid once ``done`` has completed."""
    states: list[CachedRequestState]
    done: object | None
    """torch.cuda.Event recorded after the copy (None on the CPU: already done)."""


class ModelRunner:
    def __init__(self, model: torch.nn.Module, attn_backend, kv_caches: list[torch.Tensor],
                 block_size: int, eos_token_ids: frozenset[int], device: torch.device):
        self.model = model
        self.backend = attn_backend
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.eos_token_ids = eos_token_ids
        self.device = device
        self.sampler = Sampler()
        self.states: dict[str, CachedRequestState] = {}
        self.ops = None
        """FusedOps when the model runs its fused-kernel path (CUDA + Triton backend)."""
        self.graphs = None
        """DecodeGraphs replaying decode-only steps (CUDA), or None: every step eager."""
        self.kv_mirror = DecodeKVMirror(len(kv_caches)) if device.type == "cpu" else None
        """CPU: decode K/V kept contiguous between steps (trellm/attention/kv_mirror.py)."""
        self.step_count = 0

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> StepResult:
        self._update_states(plan)
        if plan.is_empty:
            return StepResult()
        batch, logits = self._forward(plan)
        return self._sample(batch, logits)

    def can_launch(self, plan: StepPlan) -> bool:
        """Whether ``launch`` can run the plan: every request samples on the device
        alone (no log-probs, no penalties or min_tokens that read past tokens)."""
        if plan.is_empty:
            return False
        params = {new.request_id: new.sampling_params for new in plan.new_requests}
        for rid in plan.num_scheduled_tokens:
            p = params.get(rid) or self.states[rid].params
            if not is_device_only(p):
                return False
        return True

    @torch.inference_mode()
    def launch(self, plan: StepPlan) -> "LaunchedStep":
        """Queue the step on the device and return at once; ``resolve`` gives its result.
        Sampled tokens stay on the device as the next step's inputs, so the host can
        plan and prepare step n+1 while the device runs step n."""
        self._update_states(plan)
        batch, logits = self._forward(plan)
        if not batch.samplers:
            return LaunchedStep(None, None, [], None)
        rows = self._sampling_rows(batch)
        picked = [r for _, r in batch.samplers]
        if picked != list(range(logits.shape[0])):  # all rows sample in a decode step: no gather
            logits = logits[device_tensor(picked, logits.device)]
        tokens = self.sampler.sample_on_device(logits, rows)
        for i, (st, _) in enumerate(batch.samplers):
            st.pending = (tokens, i)
        host = tokens.to("cpu", non_blocking=True) if tokens.is_cuda else tokens
        done = None
        if tokens.is_cuda:
            done = torch.cuda.Event()
            done.record()
        return LaunchedStep(tokens, host, [st for st, _ in batch.samplers], done)

    def resolve(self, step: "LaunchedStep") -> StepResult:
        """Wait for a launched step's tokens and hand them to the scheduler."""
        if step.host_tokens is None:
            return StepResult()
        if step.done is not None:
            step.done.synchronize()
        sampled: dict[str, tuple[int, ...]] = {}
        for st, tok in zip(step.states, step.host_tokens.tolist()):
            st.output_token_ids.append(tok)
            if st.pending is not None and st.pending[0] is step.tokens:
                st.pending = None  # else a later launched step's token is the one in flight
            sampled[st.request_id] = (tok,)
        return StepResult(sampled_token_ids=sampled)

    def _forward(self, plan: StepPlan) -> tuple[BatchInputs, torch.Tensor | None]:
        self.step_count += 1
        batch = build_batch(plan, self.states, self.block_size, self.device, self.kv_mirror, self.step_count)
        # Graphs take steps whose every row is a decode token with a logits row, in order.
        if (self.graphs is not None and not batch.prompt_spans
                and len(batch.logits_index) == len(batch.input_ids)
                and self.graphs.can_run(batch.meta, len(batch.input_ids))):
            logits = self.graphs.run(batch.input_ids, batch.positions, batch.meta)
        else:
            ctx = ForwardContext(self.backend, self.kv_caches, batch.meta, ops=self.ops)
            hidden = self.model(batch.input_ids, batch.positions, ctx)
            logits = self.model.compute_logits(hidden[batch.logits_index]) if len(batch.logits_index) else None
        for rid, n in plan.num_scheduled_tokens.items():
            self.states[rid].num_computed_tokens += n
        return batch, logits

    def _update_states(self, plan: StepPlan) -> None:
        for rid in plan.finished_request_ids:
            self.states.pop(rid, None)
        for new in plan.new_requests:
            self.states[new.request_id] = CachedRequestState(
                request_id=new.request_id,
                prompt_token_ids=list(new.prompt_token_ids),
                output_token_ids=list(new.output_token_ids),
                params=new.sampling_params,
                block_ids=list(new.block_ids),
                num_computed_tokens=new.num_computed_tokens,
                generator=make_generator(new.sampling_params.seed, self.device),
            )
        for cached in plan.cached_requests:
            st = self.states[cached.request_id]
            st.block_ids.extend(cached.new_block_ids)
            st.num_computed_tokens = cached.num_computed_tokens

    def _sampling_rows(self, batch: BatchInputs) -> list[SamplingRow]:
        for st, _ in batch.samplers:
            self._reseed(st)
        return [SamplingRow(st.params, st.prompt_token_ids, st.output_token_ids,
                            self.eos_token_ids, st.generator) for st, _ in batch.samplers]

    @staticmethod
    def _reseed(st: CachedRequestState) -> None:
        # Seed each draw from (seed, output position): a seeded request then gives
        # the same tokens whatever its batch, and after preemption, with no replay.
        if st.generator is not None:
            st.generator.manual_seed((st.params.seed * 1_000_003 + st.num_output_tokens) % (2**63))

    def _sample(self, batch: BatchInputs, logits: torch.Tensor | None) -> StepResult:
        sampled: dict[str, tuple[int, ...]] = {}
        logprobs: dict[str, tuple[TokenLogprobs, ...]] = {}
        prompt_lps: dict[str, tuple[TokenLogprobs | None, ...]] = {}
        if batch.samplers:
            rows = self._sampling_rows(batch)
            picked = [r for _, r in batch.samplers]
            if not batch.prompt_spans and picked == list(range(logits.shape[0])):
                # Every row, in order (a decode step): no gather copy. The sampler does not
                # edit its input (penalties and temperature make new tensors), and without
                # prompt spans nothing reads logits after it.
                rows_logits = logits
            else:
                rows_logits = logits[device_tensor(picked, logits.device)]
            tokens, lps = self.sampler(rows_logits, rows)
            for (st, _), tok, lp in zip(batch.samplers, tokens, lps):
                st.output_token_ids.append(tok)
                sampled[st.request_id] = (tok,)
                if lp is not None:
                    logprobs[st.request_id] = (lp,)
        for span in batch.prompt_spans:
            entries: list[TokenLogprobs | None] = [None] if span.first_chunk else []
            if len(span.rows):
                sl = logits[span.rows.start:span.rows.stop]
                tgt = torch.tensor(span.target_ids, device=sl.device)
                entries.extend(compute_prompt_logprobs(sl, tgt, span.state.params.prompt_logprobs or 0))
            prompt_lps[span.state.request_id] = tuple(entries)
        return StepResult(sampled_token_ids=sampled, logprobs=logprobs, prompt_logprobs=prompt_lps)
