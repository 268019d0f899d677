"""What one decode step costs, estimated from bytes and bandwidths: the traffic model.

In three parts: :mod:`.traffic` (what a step moves and the rates it is read at: the model's
inputs and the rules every price shares), :mod:`.host` (the host CPU's part: host-compute
groups, their device shares and crossover) and :mod:`.step` (the step itself: overlap,
speculation, batch; :func:`~.step.step_cost`).

A decode step of a memory-bound model reads every resident weight once from VRAM, every
offloaded weight once over the link, and each sequence's KV cache. The levers that
change what that costs per generated token are priced here; every figure is an estimate
(``est_``), and :data:`~selective_offload.plan_format.EST_IGNORES` says what it leaves out.

- **Overlap and rate, as each mechanism moves bytes.** vLLM's prefetch offloader copies
  the next offloaded layer with the copy engine (the pinned copy rate) while the layers
  between it and the previous offloaded layer compute, so an offloaded layer costs about
  ``max(its copy, the compute it hides behind)`` plus its own compute, not the sum
  (:func:`pipelined_step_s`). vLLM's ``cpu_offload_gb``, the
  UVA embedding and experts read in place are read by the kernels through UVA: in line,
  no overlap (:func:`inline_step_s`), at the UVA read rate, which is below the copy rate
  (:data:`DEFAULT_UVA_READ_FACTOR`, or what ``selective-offload probe`` measured).
- **Decode reads of VRAM.** A step's weights and KV are read by decode kernels (GEMVs and
  small GEMMs, attention), which reach a fraction of a box's datasheet or saturating-read
  rate (:data:`DEFAULT_DECODE_READ_FACTOR`), unless the rate given is one measured the way
  decode reads (the probe's matrix-vector product: :func:`decode_read_rate`).
- **Compute.** Given the card's matmul rate, each layer costs at least its FLOPs at the
  step's tokens (:func:`flops_per_token`); without one, compute is not priced.
- **Batch.** ``N`` concurrent sequences share one pass over the weights (and one trip of
  every offloaded byte over the link); each adds its own embedding rows and KV reads.
- **Speculative decoding.** An MTP head drafts ``K`` tokens (``K`` passes over the head and
  the LM head it shares), then one target pass verifies ``K + 1`` tokens per sequence.
  With a per-token acceptance rate ``a``, a step yields on average
  ``E(K, a) = (1 - a**(K + 1)) / (1 - a)`` tokens per sequence (the accepted prefix plus
  the target's own next token; :func:`expected_tokens_per_step`). Speculation pays when
  ``E(K, a) / (step + draft) > 1 / step_without``; the head's bytes also displace decoder
  layers to the host, which the placement prices.
- **Routed experts (MoE).** A token runs ``k`` of a layer's ``E`` routed experts, so a
  step of ``T`` tokens (batch x tokens verified per sequence) reads the experts that at
  least one of them was routed to: ``E * (1 - (1 - k/E)**T)`` of them, assuming uniform
  routing (:func:`expert_read_fraction`, the one place that says so). Experts read in
  place from host memory through UVA cross the link at that fraction, in line; experts
  resident on the device are read from VRAM at that fraction; experts inside a layer the
  prefetch offloader copies cross the link whole.
- **Routed experts computed on the host CPU (host-compute).** The experts live in host
  memory; at a step of ``T`` tokens the host reads the distinct experts the step uses at the
  host kernel's rate and computes them (at least their FLOPs at the CPU's matmul rate), with
  a fixed hand-off per layer (hidden states and top-k down, the weighted sum back). Above a
  crossover ``T`` the same distinct experts are instead copied over the link at the pinned
  copy rate and computed on the GPU by torch ops (:func:`host_compute_crossover`). The CPU's
  work and the GPU's work of a layer are sequential (the layer's output is the next layer's
  input, and the GPU waits for the sum). The copy engine does not wait: the prefetch
  offloader's next copy runs behind the CPU's time as behind the GPU's, but the copy and
  the CPU kernel both read host memory, so that stretch takes at least their host reads
  one after the other at the kernel's rate (:func:`pipelined_step_s`). Ranks sharing the
  host (tensor or expert parallel) each compute their share with their share of the host's
  memory bandwidth.
  With a device share, part of each layer is also held on the device and the GPU computes
  the picks that land there while the CPU computes the rest; the layer costs the longer of
  the two, the GPU's part priced by the bytes its torch path moves
  (:func:`device_share_traffic`: held in bf16, a decode step's pick slots gathered; MXFP4
  experts held as stored, each picked one read once by the share kernel).
- **KV cache.** Bytes per token from the model's attention layers (KV heads x head dim,
  MLA's latent, sliding windows capped at their window) plus the fixed state of
  linear-attention layers (:class:`KvModel`); a step reads each sequence's context.

Default acceptance rate: :data:`DEFAULT_ACCEPT_RATE`.
"""
