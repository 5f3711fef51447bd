"""The consumer runtime: a verified chain product loaded into a transformers model, and quality at its output.

What it owns:
- ``fq.runtime.load``: a product, (a) a published tree and its signed plan or (b) a base directory, the adapter
  ``fq combine`` wrote (possibly narrowed to some experts) and that plan, turned into a transformers 5.x model
  (CPU, float32) whose routed-expert linears hold the SUM of their chain's reconstructions
  (``fq.codec.reconstruct_chain``) and whose other tensors are the base's skeleton, verbatim. Everything is
  verified under the pinned key before a tensor is built, by the code ``fq combine`` runs
  (``fq.provenance.product.open_product``, ``fq.provenance.combine.verify_fragments`` / ``verify_adapter``,
  ``fq.provenance.manifest.verify_base``);
  the bytes then used are the ones hashed. After transformers' weight conversion (it fuses experts into 3-D
  parameters) the loaded model is read back and compared with what was handed over, tensor by tensor.
- ``fq.runtime.exl3``: the same verified product in exllamav3 on CUDA: the base staged from the verified bytes into
  a private directory and loaded by exllamav3; in each chained MoE layer every expert linear is the float32 sum of
  its stages' EXL3 GEMMs (``ChainLinear``), never a dequantized weight.
- ``fq.runtime.quality``: KL divergence of next-token distributions against a reference model, perplexity and
  top-1 agreement on token windows; deterministic on the CPU (one thread, fixed batches, exact sums).

What it may import: fq's consumer side (fq.provenance: product, combine, manifest, adapter, selection; fq.model:
shards, experts; fq.codec; fq.core; fq.errors), torch, transformers, tokenizers and exllamav3 (lazily:
``import fq.runtime`` loads none of them). Never fq.workflow or fq.tp: the campaign side (``fq.workflow.eval``)
imports this package, not the other way round (tests/test_layering.py).
"""
