"""Helpers every layer shares and that know nothing of models, codecs or campaigns.

    canonical      canonical JSON (what fq hashes and signs) and the strict loader of every JSON document fq reads
    atomic         crash-safe writes: temp name, fsync, rename, fsync the directory
    safepath       names inside a campaign or published tree, opened without leaving it; sha256_file
    paths          a command's output and input paths checked before any work (writable, not a directory, UTF-8)
    schema_check   a document against one of fq's packaged schemas (fq/schemas/), with one precise error line
    units          bytes and durations as operators type them and as fq prints them
    layer_ranges   layer ranges ("3-12,13-40") and the check that windows partition the layers

What it may import: fq.errors and fq.display, the standard library, jsonschema. Nothing else of fq.
"""
