"""``fq promote``: publish a finalized campaign so that a consumer sees a whole family or none of it.

A campaign directory (``OUT``) holds much more than its products: logs, locks, keys, metrics, staging,
committed fragments. What it *publishes* is exactly

    base/NODE/...  stages/NODE/...  assemblies/...   (from OUT/published)
    publication.intoto.jsonl                        (OUT/published: the signed publication statement)
    campaign_summary.json                           (OUT/campaign_summary.json)

and that set is enumerated here, never derived by excluding operational files: whatever else a
campaign directory accumulates can never leak into a publication. Anything else inside ``published/``
is refused by name (finalize refuses such strays too).

Destinations: a local publication directory (``fq.promote.local``) or a Hugging Face repository
(``fq.promote.hub``). Both verify with the pinned key before anything becomes visible, and both refuse a
publication whose version (its signed publication statement's, the operator's ``assembly.version``) is not
above the version the destination already published (``check_version``): consumers keep the highest
version they saw per signer, so a lower one would be refused by them anyway, and a changed publication under
the same version would be called a different one.

What it may import: fq.provenance (publication, summary, verify), fq.core, fq.errors, huggingface_hub (in
fq.promote.hub, lazily). Never fq.workflow (its neighbour in the layer: promotion reads a finalized campaign's
files, not its code) or the CLI.
"""
from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path

from fq.core import canonical
from fq.core.safepath import check_name, describe_mode, sha256_file
from fq.errors import FqError
from fq.provenance.publication import NAME as PUBLICATION_NAME, Statement, read_publication
from fq.provenance.summary import SUMMARY_NAME

PUBLISHABLE_DIRS = ("base", "stages", "assemblies")
PUBLISHABLE_FILES = (PUBLICATION_NAME,)  # at the root of published/


def is_publishable(name: str) -> bool:
    """A path a publication may hold (repository-relative)."""
    return name in (SUMMARY_NAME, *PUBLISHABLE_FILES) or name.split("/", 1)[0] in PUBLISHABLE_DIRS and "/" in name


@dataclass(frozen=True)
class Publication:
    """The publishable files of one campaign: published name -> local file."""
    campaign: Path
    files: dict[str, Path]

    @property
    def published(self) -> Path:
        return self.campaign / "published"

    @property
    def summary(self) -> Path:
        return self.campaign / SUMMARY_NAME

    def digests(self) -> dict[str, tuple[str, int]]:
        """name -> (sha256, size), computed once: from ``verified`` (``adopt``) where it has the file, else hashed."""
        cached = self.__dict__.get("_digests")
        if cached is None:
            known = self.__dict__.get("_verified", {})
            cached = {n: (known.get(n) or sha256_file(p), p.stat().st_size) for n, p in sorted(self.files.items())}
            object.__setattr__(self, "_digests", cached)
        return cached

    def adopt(self, report) -> None:
        """Take the digests a successful ``verify_path(self.published)`` checked (``VerifyReport.digests``): the files are
        not hashed a second time, and nothing is hashed before its listed size was compared."""
        if not report.ok:
            raise FqError(f"promote {self.campaign}: adopting digests of a tree that did not verify")
        object.__setattr__(self, "_verified", dict(report.digests))
        self.__dict__.pop("_digests", None)

    def digest(self) -> str:
        """Content digest of the whole publication: names, sizes and sha256 of every file."""
        return canonical.sha256_hex(canonical.dumps([[n, s, z] for n, (s, z) in self.digests().items()]))


def collect(campaign: str | os.PathLike) -> Publication:
    """Enumerate what ``campaign`` publishes; refuse anything under ``published/`` that is not publishable."""
    campaign = Path(campaign)
    published = campaign / "published"
    if not campaign.is_dir():
        raise FqError(f"{campaign}: not a campaign directory")
    if campaign.name == "published" and not published.exists():
        raise FqError(f"{campaign}: give the campaign directory (the one holding published/ and {SUMMARY_NAME})")
    for path, want in ((published, stat.S_ISDIR), (campaign / SUMMARY_NAME, stat.S_ISREG)):
        if not os.path.lexists(path):
            raise FqError(f"{path}: missing; finalize the campaign first")
        mode = os.lstat(path).st_mode
        if not want(mode):
            raise FqError(f"{path}: is {describe_mode(mode)}, expected a real "
                          f"{'directory' if want is stat.S_ISDIR else 'file'}")
    files: dict[str, Path] = {SUMMARY_NAME: campaign / SUMMARY_NAME}
    problems = []
    for dirpath, dirnames, filenames in os.walk(published):
        rel_dir = Path(dirpath).relative_to(published).as_posix()
        for name in sorted(dirnames + filenames):
            path = Path(dirpath, name)
            rel = name if rel_dir == "." else f"{rel_dir}/{name}"
            mode = os.lstat(path).st_mode
            if rel_dir == "." and not (stat.S_ISDIR(mode) and name in PUBLISHABLE_DIRS or
                                       stat.S_ISREG(mode) and name in PUBLISHABLE_FILES):
                problems.append(f"{path}: not a publishable path (only "
                                f"{', '.join([d + '/' for d in PUBLISHABLE_DIRS] + list(PUBLISHABLE_FILES))})")
            elif name.startswith(".tmp-"):
                problems.append(f"{path}: leftover temp file of an interrupted write; re-run finalize")
            elif stat.S_ISLNK(mode) or not (stat.S_ISDIR(mode) or stat.S_ISREG(mode)):
                problems.append(f"{path}: is {describe_mode(mode)}; a publication holds only real files")
            elif stat.S_ISREG(mode):
                try:
                    files[check_name(rel, str(path))] = path
                except FqError as e:
                    problems.append(str(e))
        dirnames[:] = sorted(d for d in dirnames if not os.path.islink(os.path.join(dirpath, d))
                             and (rel_dir != "." or d in PUBLISHABLE_DIRS))
    if problems:
        raise FqError(f"promote {campaign}: {len(problems)} problem(s): " + "; ".join(problems))
    if len(files) == 1:
        raise FqError(f"{published}: nothing published; finalize the campaign first")
    return Publication(campaign, dict(sorted(files.items())))


def publication_of(pub: Publication, key) -> Statement:
    """The campaign's signed publication statement (verified under ``key``)."""
    if PUBLICATION_NAME not in pub.files:
        raise FqError(f"{pub.published / PUBLICATION_NAME}: missing; finalize the campaign with this fq version "
                      "(it signs the publication statement)")
    return read_publication(pub.published, key)


def check_version(new: Statement, previous: list[tuple[str, int]], where: str) -> None:
    """``previous``: (what, version) of every publication the destination has held under this key."""
    for what, version in sorted(previous, key=lambda p: -p[1])[:1]:  # the highest version held
        if new.version <= version:
            raise FqError(f"{where}: publication version {new.version} is not above version {version} of {what}; "
                          f"consumers refuse a lower version and a changed publication under the same one "
                          f"(raise assembly.version and finalize again)")


def raise_report(report, what: str) -> None:
    if not report.ok:
        raise FqError(f"{what}: {len(report.problems)} problem(s): " + "; ".join(report.problems))
