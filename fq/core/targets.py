"""The runtime release fq's products are made for and checked against.

exllamav3's tensor format, its loader's asserts and its converter's choices are read from this release
(../shared/EXL3-RUNTIME.md, docs/families.md); the published ``quantization_config`` names it
(fq.provenance.exl3config.VERSION), and every message about what the runtime would load says which one. Comments
and docstrings that cite this release's code keep the literal version: they describe that code.
"""
EXLLAMAV3 = "1.6.5"
