"""A campaign's calibration targets: tokens -> embeddings -> the source layer by layer, each calibrated MoE layer's
Hessians (and, with whole-model bases, its quantized linears' input Hessians), and which windows each chain job reads
(docs/calibration.md). ``Campaign.calib``."""
from __future__ import annotations

from functools import cached_property
from pathlib import Path

from fq.errors import FqError
from fq.hessian import store
from fq.workflow.specs import HessianRef

CALIB_ROWS, CALIB_COLUMNS = 250, 2048  # calibration tokens per campaign by default (as exllamav3's converter)


class CalibrationTargets:
    def __init__(self, campaign):
        self.c = campaign  # fq.workflow.campaign.Campaign: what every job shares

    @cached_property
    def settings(self) -> dict | None:
        """``calibration:`` of the config with its defaults (None: weight-only encoding, the attestations say so)."""
        cfg = self.c.config.get("calibration")
        if not cfg:
            return None
        text, tokens = cfg.get("text"), cfg.get("tokens")
        if text and tokens:
            raise FqError("calibration: name text or tokens, not both")
        if (text or tokens) and not cfg.get("sha256"):
            raise FqError(f"calibration.sha256: required with calibration.{'text' if text else 'tokens'} (the file's "
                          "sha256: the Hessians, and every fragment encoded against them, are bound to those bytes)")
        if not (text or tokens) and self.c.source_kind != "demo":
            raise FqError("calibration.text: name a calibration text (or calibration.tokens); only the demo source "
                          "brings its own")
        if text and self.c.source_kind == "hub":
            raise FqError("calibration.text: a hub source's tokenizer is not on disk; give calibration.tokens "
                          "(fq.hessian.calibration.save_tokens) instead")
        return {"text": text, "tokens": tokens, "sha256": cfg.get("sha256"), "rows": int(cfg.get("rows", CALIB_ROWS)),
                "columns": int(cfg.get("columns", CALIB_COLUMNS)), "capture": cfg.get("capture", "all-experts"),
                "weighting": cfg.get("weighting", "none"),
                "compare_weight_only": _twins(cfg.get("compare_weight_only", False))}

    @property
    def text(self) -> str:
        return self.settings["text"] or self.c.p("demo-text", "calibration.txt")

    @cached_property
    def calibrated_layers(self) -> tuple[int, ...]:
        """MoE layers whose fragments are encoded against a Hessian (next-token layers stay weight-only: the
        calibration chain runs the decoder stack, which they are not part of)."""
        if not self.settings:
            return ()
        return tuple(l for l in self.c.source.moe_layers if l not in self.c.source.mtp_layers)

    @property
    def chain_layers(self) -> tuple[int, ...]:
        """Every decoder layer the chain runs: 0 .. the last calibrated layer (every decoder layer when the head's
        Hessian is captured: it reads the last layer's output)."""
        if not self.calibrated_layers:
            return ()
        if None in self.linear_capture:
            return tuple(range(self.c.source.num_hidden_layers))
        last = max([*self.calibrated_layers, *(l for l in self.linear_capture if l is not None)])
        return tuple(range(last + 1))

    def path(self, name: str) -> str:
        return self.c.p("calibration", name)

    @property
    def tokens(self) -> str:
        return self.path("tokens.safetensors")

    def hidden(self, layer: int | None) -> str:
        """The hidden states entering layer ``layer + 1`` (None: the embeddings, entering layer 0)."""
        return self.path("hidden-embed.safetensors" if layer is None else f"hidden-layer{layer:03d}.safetensors")

    def hessian(self, layer: int) -> str:
        return self.path(store.file_name(layer))

    def hessian_binding(self, layer: int) -> str:
        return self.path(f"hessian-layer{layer:03d}.bound.json")

    def linear_hessian(self, layer: int | None) -> str:
        """The input Hessians of a layer's (None: the head's) quantized non-expert linears (fq.hessian.linear_store)."""
        from fq.hessian.linear_store import linear_file_name

        return self.path(linear_file_name(layer))

    def hessian_ref(self, layer: int) -> HessianRef | None:
        """Where an encode job of ``layer`` finds its Hessian and the campaign's binding of it (None: weight-only)."""
        if layer not in self.calibrated_layers:
            return None
        return HessianRef(path=self.hessian(layer), binding=self.hessian_binding(layer),
                          weighting=self.settings["weighting"])

    def linear_hessian_ref(self, layer: int | None) -> HessianRef | None:
        """Where a linear job of ``layer`` (None: the head) finds its linear Hessians (None: weight-only)."""
        if not self.settings:
            return None
        return HessianRef(path=self.linear_hessian(layer), binding=self.linear_hessian_binding(layer))

    def linear_hessian_binding(self, layer: int | None) -> str:
        return self.path(Path(Path(self.linear_hessian(layer)).name).stem + ".bound.json")

    def head_norm_skeleton(self) -> list[str]:
        """The committed skeleton shard holding the final norm (what the head's calibration job reads)."""
        norm = self.c.layout.layers.removesuffix("layers.") + "norm.weight"
        if norm not in self.c.source.weight_map:
            raise FqError(f"campaign {self.c.name}: the source has no final norm {norm}; the head's Hessian needs it")
        return [self.c.skeleton(self.c.source.weight_map[norm])]

    @cached_property
    def linear_capture(self) -> dict[int | None, tuple[str, ...]]:
        """layer (None: the head) -> the quantized linears whose input Hessians its calibration job captures
        (calibrated campaigns with whole-model bases; every class any base quantizes)."""
        if not self.settings:
            return {}
        out: dict = {}
        for node, layer in self.c.linears.jobs:
            out.setdefault(layer, set()).update(self.c.linears.names(node, layer))
        return {l: tuple(sorted(v)) for l, v in out.items()}

    @cached_property
    def _layer_tensor_shards(self) -> dict[int | None, tuple[str, ...]]:
        import re

        layout = self.c.layout  # model.layers.*, or a vision-language checkpoint's model.language_model.layers.*
        layer_re = re.compile(re.escape(layout.layers) + r"(\d+)\.")
        embed = layout.embed.removesuffix("weight")
        out: dict = {}
        for name, shard in self.c.source.weight_map.items():
            m = layer_re.match(name)
            if m:
                out.setdefault(int(m.group(1)), set()).add(shard)
            elif name.startswith(embed):
                out.setdefault(None, set()).add(shard)
        return {k: tuple(sorted(v)) for k, v in out.items()}

    def shards(self, layer: int | None) -> tuple[str, ...]:
        """Source shards the chain's job for ``layer`` reads (None: the embedding job)."""
        shards = self._layer_tensor_shards.get(layer, ())
        if not shards:
            embed = self.c.layout.embed.removesuffix(".weight")
            raise FqError(f"campaign {self.c.name}: the source has no tensors for "
                          f"{embed if layer is None else f'layer {layer}'}")
        return shards

    def record(self, layer: int | None) -> str:
        """The job's record (what it read and wrote, with digests): small, kept; what retirement waits for."""
        return self.path("embed.json" if layer is None else f"layer{layer:03d}.json")

    def outputs(self, layer: int | None) -> list[str]:
        """hidden (temp: the next job's input), the Hessian file (calibrated MoE layers), the linear Hessians (layers
        with quantized non-expert linears), the record."""
        hessian = [self.hessian(layer)] if layer is not None and layer in self.calibrated_layers else []
        if layer is not None and layer in self.linear_capture:
            hessian.append(self.linear_hessian(layer))
        return [self.hidden(layer)] + hessian + [self.record(layer)]

    def _retiring_window(self, shard: str) -> int:
        for w in self.c.plan.windows:
            if shard in w.retire:
                return w.index
        return self.c.shard_window(shard)

    @cached_property
    def windows(self) -> dict:
        """Per chain job (None: embed), the windows that retire the shards it reads. Refuses a layout where a job
        would need a shard that is staged only after one it reads is retired (the chain could never run)."""
        out = {}
        W = self.c.plan.windows_on_disk
        for layer in (None,) + self.chain_layers:
            shards = self.shards(layer)
            staged = max(self.c.shard_window(s) for s in shards)
            retired = min(self._retiring_window(s) for s in shards)
            if staged - W >= retired:
                what = "the embeddings" if layer is None else f"layer {layer}"
                raise FqError(f"campaign {self.c.name}: calibration of {what} "
                              f"reads shards {list(shards)} staged by windows {retired}..{staged}, more than "
                              f"windows_on_disk={W} apart; raise windows_on_disk or merge those windows")
            out[layer] = {self._retiring_window(s) for s in shards}
        return out


def check_weighting(cfg: dict, family, where: str) -> str:
    """calibration.weighting (default none), refused for a family whose router scores the chain cannot read
    (fq.hessian.affinity) and beside a routed-only capture (a weighting reaches every token)."""
    from fq.hessian.affinity import check_weighting as check_family

    weighting = cfg.get("weighting", "none")
    check_family(family, weighting, where)
    if weighting != "none" and cfg.get("capture", "all-experts") != "all-experts":
        raise FqError(f"{where}: calibration.weighting {weighting} weights every token by the router's score of each "
                      f"expert; it takes capture: all-experts, not {cfg.get('capture')}")
    return weighting


def _twins(value) -> bool | tuple[str, ...]:
    """calibration.compare_weight_only: True / False, or the named nodes (a tuple) whose chains get twins."""
    return tuple(value) if isinstance(value, (list, tuple)) else bool(value)
