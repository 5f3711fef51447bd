"""Calibration Hessians of a source MoE checkpoint: H = XᵀX per distinct routed-expert linear input.

What exllamav3's converter computes before it quantizes a layer (../shared/EXL3-RUNTIME.md, "The converter's
quantization"), made a campaign artifact: calibration tokens are embedded and advanced through the SOURCE model
one decoder layer at a time (transformers' own layer module, float32, the model's true routing), and at each MoE
layer the inputs of its routed experts are summed into Hessians:

- ``input``: the MoE block's input (the post-attention RMSNorm output), shared by every routed expert's gate and
  up projection (and by the shared expert's);
- ``down.{e}``: the input of expert e's down projection, ``act(gate(x))·up(x)``, over every token (all-experts
  capture, as exllamav3 does for the GLM / Qwen3 / DeepSeek classes) or, with ``routed_only``, over the tokens the
  router sends to e;
- with a router-affinity weighting (``affinity``), each token's term of ``down.{e}`` (and of a per-expert
  ``input.{e}``) times the router's score of e.

Modules (one job per layer is what the workflow runs; ``capture_all`` chains them for tests and the demo):

    calibration  calibration tokens [rows, cols] from a text file (sha256-checked) or a token file, and their digest
    layer        the architecture registry, a layer's tensors streamed from the shards, one decoder layer built
    capture      embed / advance (the chain), hidden-state files, capture_layer (one job), capture_all
    affinity     the router-affinity weighting (calibration.weighting): each token's term of an expert's Hessians
                 times the router's score of the expert, read from the family's own router
    store        the Hessian file (hessian-layer{L:03d}.safetensors): packed fp32 upper triangles, read back checked
    linear_store the non-expert linears' input Hessians (linears-layer{L:03d}.safetensors, linears-head): per input
                 group, the same packing (whole-model bases)

Owns: everything under ``fq/hessian/``. May import: ``fq.errors``, ``fq.core.atomic``, ``fq.core.canonical``, ``fq.model.shards``,
``fq.core.safepath`` and its own modules; torch, transformers and tokenizers only inside functions (importing this
package or any of its modules loads no torch). Codec-free: nothing here imports ``fq.codec``; an encoder reads the
Hessian file (``store.read_hessians``) and binds to it by the file's sha256.
"""
