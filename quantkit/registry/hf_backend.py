"""Hugging Face Hub backend (`hf://org/name`, or `hf://org` with the name from --name / the recipe).

A model is one Hub repo; a version is a git tag `v<N>` on its main branch; an alias ("production") is a
git tag moved to the version's commit. Publishing goes through a pull request, so main never holds a
half-uploaded version:

1. create the repo if needed (exist_ok); N = highest `v<N>` tag + 1;
2. one `create_commit(create_pr=True)` with every file of the bundle, `quantkit/version.json` (N and the
   tags), and deletions of files an older version had but this one does not;
3. list the PR commit's tree and check every file is there with its size and its sha256 (LFS files) or
   git blob id (small files); only then `merge_pull_request`;
4. check main's tree the same way, then `create_tag("v<N>")` on main's commit.
A failure before the merge closes the PR (`change_discussion_status(..., "closed")`): nothing reached main
and no version exists. A failure after the merge but before the tag leaves the files on main without a
version tag: no version is registered and every existing tag/alias still serves what it served.

Trade-offs and limits, stated plainly: moving an alias is delete_tag + create_tag (two calls, so there
is a moment with no alias), and the Hub keeps no alias history, so rollback goes to the highest version
below the current one. Two concurrent publishes to one repo can race on N; the second create_tag fails
(exist_ok=False) and reports it. Tokens come from huggingface_hub's own lookup (HF_TOKEN or `hf auth
login`). This backend was only exercised offline, against a fake HfApi that records the calls; the Hub
is unreachable from where it was written. See docs/registry.md.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

from quantkit.io import atomic_write_json, sha256_file
from quantkit.registry.base import Bundle, RegistryClient, RegistryError, VersionInfo

HF_URI = re.compile(r"^hf://(?P<org>[A-Za-z0-9][\w.-]*)(?:/(?P<name>[A-Za-z0-9][\w.-]*))?/?$")
VERSION_TAG = re.compile(r"^v(\d+)$")
VERSION_META = "quantkit/version.json"
KEEP = {".gitattributes"}


def parse_hf_uri(uri: str) -> tuple[str, str | None]:
    m = HF_URI.match(uri)
    if not m:
        raise RegistryError(f"registry {uri!r}: expected hf://org/name or hf://org (letters, digits, '.', '_', '-')")
    return m["org"], m["name"]


def git_blob_sha1(path: Path) -> str:
    """The git object id of a file, which the Hub reports as `blob_id` for files not stored in LFS."""
    h = hashlib.sha1()
    h.update(f"blob {path.stat().st_size}\0".encode())
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    return h.hexdigest()


class HfRegistry(RegistryClient):
    def __init__(self, uri: str, api=None, private: bool | None = None):
        self.uri = self.explicit_uri = uri
        self.org, self.repo_name = parse_hf_uri(uri)
        if api is None:
            from huggingface_hub import HfApi

            api = HfApi()
        self.api = api
        self.private = private

    def repo_id(self, name: str | None) -> str:
        if self.repo_name:
            if name not in (None, self.repo_name, f"{self.org}/{self.repo_name}"):
                raise RegistryError(f"registry {self.uri} is repo {self.org}/{self.repo_name}, but the model name is "
                                    f"{name!r}; use hf://{self.org} to take the name from --name, or pass "
                                    f"--name {self.repo_name}")
            return f"{self.org}/{self.repo_name}"
        if not name:
            raise RegistryError(f"registry {self.uri}: give a model name (--name) or use hf://{self.org}/NAME")
        return f"{self.org}/{name.split('/')[-1]}"

    def default_name(self) -> str | None:
        return self.repo_name

    # ---------------------------------------------------------------------------------- refs
    def _tags(self, repo: str) -> dict[str, str]:
        """tag name -> commit."""
        return {t.name: t.target_commit for t in self.api.list_repo_refs(repo, repo_type="model").tags}

    def _tree(self, repo: str, revision: str) -> dict:
        from huggingface_hub.hf_api import RepoFile

        return {f.path: f for f in self.api.list_repo_tree(repo, revision=revision, recursive=True, repo_type="model")
                if isinstance(f, RepoFile)}

    def _check_tree(self, repo: str, revision: str, expected: dict[str, tuple[int, str, str]]) -> None:
        tree = self._tree(repo, revision)
        bad = []
        for rel, (size, sha256, blob) in expected.items():
            f = tree.get(rel)
            if f is None:
                bad.append(f"{rel}: missing")
            elif f.size != size:
                bad.append(f"{rel}: {f.size} bytes, expected {size}")
            elif f.lfs is not None and f.lfs.sha256 != sha256:
                bad.append(f"{rel}: LFS sha256 differs")
            elif f.lfs is None and f.blob_id != blob:
                bad.append(f"{rel}: git blob id differs")
        if bad:
            raise RegistryError(f"hf://{repo}@{revision[:12]}: files not as uploaded: " + "; ".join(bad))

    # ---------------------------------------------------------------------------------- publish
    def publish(self, bundle: Bundle, staging: Path) -> VersionInfo:
        from huggingface_hub import CommitOperationAdd, CommitOperationDelete

        repo = self.repo_id(bundle.name)
        self.api.create_repo(repo, repo_type="model", exist_ok=True, private=self.private)
        tags = self._tags(repo)
        n = max((int(m[1]) for t in tags if (m := VERSION_TAG.match(t))), default=0) + 1
        meta = staging / "version.json"
        atomic_write_json(meta, {"version": str(n), "name": repo, "tags": bundle.tags})
        files = list(bundle.files) + [(meta, VERSION_META)]
        expected = {rel: (p.stat().st_size, sha256_file(p), git_blob_sha1(p)) for p, rel in files}
        old = set(self._tree(repo, "main")) if self._has_main(repo) else set()
        ops = [CommitOperationAdd(path_in_repo=rel, path_or_fileobj=str(p)) for p, rel in files]
        ops += [CommitOperationDelete(path_in_repo=rel) for rel in sorted(old - set(expected) - KEEP)]
        info = self.api.create_commit(
            repo, ops, repo_type="model", create_pr=True,
            commit_message=f"quantkit: publish v{n} ({bundle.tags.get('quantkit.gate', '')})",
            commit_description=json.dumps(bundle.tags, indent=1, sort_keys=True))
        if info.pr_num is None:
            raise RegistryError(f"hf://{repo}: create_commit(create_pr=True) returned no pull request ({info.commit_url})")
        merged = False
        try:
            self._check_tree(repo, info.oid, expected)
            self.api.merge_pull_request(repo, info.pr_num, repo_type="model",
                                        comment=f"quantkit: all {len(expected)} files verified; merging v{n}")
            merged = True
            main = self.api.repo_info(repo, revision="main", repo_type="model").sha
            self._check_tree(repo, main, expected)
            self.api.create_tag(repo, tag=f"v{n}", revision=main, repo_type="model", exist_ok=False,
                                tag_message=f"quantkit v{n}: {bundle.tags.get('quantkit.gate', '')}")
        except BaseException as exc:
            if not merged:
                try:
                    self.api.change_discussion_status(repo, info.pr_num, "closed", repo_type="model",
                                                      comment=f"quantkit: publish failed, not merged: {exc}")
                except Exception as err:  # noqa: BLE001 - any client/HTTP error; the original error wins
                    exc.add_note(f"could not close PR #{info.pr_num} on {repo}: {err}")
            else:
                exc.add_note(f"the files are on main of {repo} but no tag v{n} was created: no version exists")
            raise
        return VersionInfo(repo, str(n), [], dict(bundle.tags), f"hf://{repo}@v{n}")

    def _has_main(self, repo: str) -> bool:
        return any(b.name == "main" for b in self.api.list_repo_refs(repo, repo_type="model").branches)

    # ---------------------------------------------------------------------------------- reading
    def list_models(self) -> list[dict]:
        names = [f"{self.org}/{self.repo_name}"] if self.repo_name else \
            [m.id for m in self.api.list_models(author=self.org)]
        out = []
        for repo in sorted(names):
            vs = self.versions(repo)
            aliases = {a: v.version for v in vs for a in v.aliases}
            out.append({"name": repo, "latest_version": vs[-1].version if vs else None, "versions": len(vs),
                        "aliases": aliases})
        return out

    def versions(self, name: str) -> list[VersionInfo]:
        repo = self.repo_id(name)
        tags = self._tags(repo)
        out = []
        for t, commit in tags.items():
            if m := VERSION_TAG.match(t):
                aliases = sorted(a for a, c in tags.items() if c == commit and not VERSION_TAG.match(a))
                out.append(VersionInfo(repo, m[1], aliases, {}, f"hf://{repo}@{t}"))
        return sorted(out, key=lambda v: int(v.version))

    def show(self, name: str, version_or_alias: str) -> VersionInfo:
        info = super().show(name, version_or_alias)
        path = self.api.hf_hub_download(info.name, VERSION_META, revision=f"v{info.version}", repo_type="model")
        info.tags = dict(json.loads(Path(path).read_text(encoding="utf-8")).get("tags", {}))
        return info

    def get_alias(self, name: str, alias: str) -> str | None:
        tags = self._tags(self.repo_id(name))
        if alias not in tags:
            return None
        for t, commit in tags.items():
            if (m := VERSION_TAG.match(t)) and commit == tags[alias]:
                return m[1]
        return None

    def alias_history(self, name: str, alias: str) -> list[str]:
        return []  # the Hub keeps none; rollback falls back to the version below the current one

    def set_alias(self, name: str, alias: str, version: str, history: list[str]) -> None:
        if VERSION_TAG.match(alias):
            raise RegistryError(f"alias {alias!r} looks like a version tag; pick another name (e.g. production)")
        repo = self.repo_id(name)
        tags = self._tags(repo)
        if alias in tags:
            self.api.delete_tag(repo, tag=alias, repo_type="model")
        self.api.create_tag(repo, tag=alias, revision=tags[f"v{version}"], repo_type="model",
                            tag_message=f"quantkit: {alias} -> v{version}")

    def download(self, info: VersionInfo, dest: Path) -> None:
        self.api.snapshot_download(info.name, revision=f"v{info.version}", local_dir=str(dest), repo_type="model")
