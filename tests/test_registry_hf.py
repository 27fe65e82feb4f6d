"""Hugging Face Hub backend, offline: URI parsing, the planned operations against a fake HfApi, refusals.

The Hub is unreachable here, so FakeHub keeps repos in memory and answers the HfApi methods the backend
calls with the library's own return types (CommitInfo, GitRefs, RepoFile). What these tests cannot show:
that the real Hub accepts these calls with these arguments (auth, LFS/Xet upload, merge permissions).
"""

from __future__ import annotations

import hashlib
import itertools
from pathlib import Path
from types import SimpleNamespace

import pytest
from _artifacts import GOOD_METRICS, make_artifact, make_report
from huggingface_hub import CommitOperationAdd, CommitOperationDelete
from huggingface_hub.hf_api import CommitInfo, GitRefInfo, GitRefs, RepoFile

from quantkit import registry
from quantkit.export.manifest import verify
from quantkit.gates import run_gates
from quantkit.recipe import GateSpec
from quantkit.registry import RegistryError
from quantkit.registry.hf_backend import HfRegistry, git_blob_sha1, parse_hf_uri

PPL_GATE = [GateSpec(metric="quality.perplexity", op="<=", threshold=1.05, relative=True)]


class Conflict(Exception):
    pass


class FakeHub:
    """In-memory Hub: commits are {path: bytes}; refs are main, tags, and refs/pr/N."""

    def __init__(self, tmp: Path, drop: set[str] = frozenset()):
        self.tmp, self.drop, self.calls = tmp, set(drop), []
        self.repos: dict[str, dict] = {}
        self._ids = itertools.count(1)

    def _sha(self) -> str:
        return hashlib.sha1(str(next(self._ids)).encode()).hexdigest()

    def _resolve(self, repo: str, rev: str) -> str:
        r = self.repos[repo]
        if rev in r["commits"]:
            return rev
        if rev in r["tags"]:
            return r["tags"][rev]
        if rev.startswith("refs/pr/"):
            return r["prs"][int(rev.split("/")[-1])]["sha"]
        return r["branches"][rev]

    def create_repo(self, repo_id, repo_type=None, exist_ok=False, private=None):
        self.calls.append(("create_repo", repo_id))
        if repo_id not in self.repos:
            sha = self._sha()
            self.repos[repo_id] = {"commits": {sha: {".gitattributes": b"*.safetensors filter=lfs\n"}},
                                   "branches": {"main": sha}, "tags": {}, "prs": {}}

    def list_repo_refs(self, repo_id, repo_type=None):
        r = self.repos[repo_id]
        return GitRefs(branches=[GitRefInfo(b, f"refs/heads/{b}", s) for b, s in r["branches"].items()],
                       converts=[], tags=[GitRefInfo(t, f"refs/tags/{t}", s) for t, s in r["tags"].items()])

    def list_repo_tree(self, repo_id, revision=None, recursive=False, repo_type=None):
        self.calls.append(("list_repo_tree", revision))
        files = self.repos[repo_id]["commits"][self._resolve(repo_id, revision or "main")]
        for path, data in files.items():
            lfs = {"size": len(data), "oid": hashlib.sha256(data).hexdigest(), "pointerSize": 130} \
                if path.endswith(".safetensors") else None
            blob = hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
            yield RepoFile(path=path, size=len(data), oid=blob, lfs=lfs)

    def create_commit(self, repo_id, operations, commit_message, commit_description=None, create_pr=None,
                      repo_type=None):
        ops = list(operations)
        self.calls.append(("create_commit", create_pr, sorted(o.path_in_repo for o in ops)))
        r = self.repos[repo_id]
        files = dict(r["commits"][r["branches"]["main"]])
        for op in ops:
            if isinstance(op, CommitOperationDelete):
                files.pop(op.path_in_repo)
            elif isinstance(op, CommitOperationAdd) and op.path_in_repo not in self.drop:
                files[op.path_in_repo] = Path(op.path_or_fileobj).read_bytes()
        sha = self._sha()
        r["commits"][sha] = files
        url = f"https://huggingface.co/{repo_id}"
        if not create_pr:
            r["branches"]["main"] = sha
            return CommitInfo(f"{url}/commit/{sha}", commit_message, commit_description or "", sha)
        num = len(r["prs"]) + 1
        r["prs"][num] = {"sha": sha, "status": "open"}
        return CommitInfo(f"{url}/commit/{sha}", commit_message, commit_description or "", sha,
                          pr_url=f"{url}/discussions/{num}")

    def merge_pull_request(self, repo_id, discussion_num, comment=None, repo_type=None):
        self.calls.append(("merge_pull_request", discussion_num))
        r = self.repos[repo_id]
        pr = r["prs"][discussion_num]
        assert pr["status"] == "open"
        sha = self._sha()
        r["commits"][sha] = dict(r["commits"][pr["sha"]])
        r["branches"]["main"], pr["status"] = sha, "merged"

    def change_discussion_status(self, repo_id, discussion_num, new_status, comment=None, repo_type=None):
        self.calls.append(("change_discussion_status", discussion_num, new_status))
        self.repos[repo_id]["prs"][discussion_num]["status"] = new_status

    def repo_info(self, repo_id, revision=None, repo_type=None):
        return SimpleNamespace(sha=self._resolve(repo_id, revision or "main"))

    def create_tag(self, repo_id, tag, revision=None, tag_message=None, repo_type=None, exist_ok=False):
        self.calls.append(("create_tag", tag, revision))
        tags = self.repos[repo_id]["tags"]
        if tag in tags and not exist_ok:
            raise Conflict(f"tag {tag} exists")
        tags[tag] = self._resolve(repo_id, revision or "main")

    def delete_tag(self, repo_id, tag, repo_type=None):
        self.calls.append(("delete_tag", tag))
        del self.repos[repo_id]["tags"][tag]

    def _write(self, repo_id, revision, dest: Path, only: str | None = None) -> Path:
        for path, data in self.repos[repo_id]["commits"][self._resolve(repo_id, revision)].items():
            if only is None or path == only:
                (dest / path).parent.mkdir(parents=True, exist_ok=True)
                (dest / path).write_bytes(data)
        return dest

    def hf_hub_download(self, repo_id, filename, revision=None, repo_type=None):
        d = self.tmp / f"dl-{self._sha()}"
        return str(self._write(repo_id, revision or "main", d, only=filename) / filename)

    def snapshot_download(self, repo_id, revision=None, local_dir=None, repo_type=None):
        return str(self._write(repo_id, revision or "main", Path(local_dir)))

    def list_models(self, author=None):
        return [SimpleNamespace(id=r) for r in self.repos if r.startswith(f"{author}/")]


def gated(folder: Path, seed: int, **kw) -> Path:
    art = make_artifact(folder, seed=seed, **kw)
    run_gates(make_report(art))
    return art


def test_parse_hf_uri_and_repo_names(tmp_path):
    assert parse_hf_uri("hf://acme/tiny-w8a8") == ("acme", "tiny-w8a8")
    assert parse_hf_uri("hf://acme") == ("acme", None)
    for bad in ("hf://", "hf://acme/a/b", "hf:/acme/x", "hf://-acme/x"):
        with pytest.raises(RegistryError, match="expected hf://org/name"):
            parse_hf_uri(bad)
    fixed = HfRegistry("hf://acme/tiny", api=FakeHub(tmp_path))
    assert fixed.repo_id(None) == fixed.repo_id("tiny") == fixed.repo_id("acme/tiny") == "acme/tiny"
    with pytest.raises(RegistryError, match="use hf://acme to take the name"):
        fixed.repo_id("other")
    assert HfRegistry("hf://acme", api=FakeHub(tmp_path)).repo_id("m") == "acme/m"
    p = tmp_path / "f"
    p.write_bytes(b"hello\n")
    assert git_blob_sha1(p) == "ce013625030ba8dba906f756967f9e9ca394464a"  # `git hash-object`


def test_publish_merges_a_verified_pr_then_tags(tmp_path):
    hub = FakeHub(tmp_path)
    reg = HfRegistry("hf://acme", api=hub)
    a1 = gated(tmp_path / "a1", 1)
    (a1 / "extra.txt").write_text("only in v1")  # unlisted in the manifest: not uploaded
    v1 = registry.publish(a1, name="tiny", client=reg)
    assert (v1.name, v1.version) == ("acme/tiny", "1")
    kinds = [c[0] for c in hub.calls]
    i_commit, i_merge, i_tag = kinds.index("create_commit"), kinds.index("merge_pull_request"), kinds.index("create_tag")
    assert hub.calls[i_commit][1] is True  # create_pr=True
    assert i_commit < kinds.index("list_repo_tree", i_commit) < i_merge < i_tag  # verified before merging
    main = hub.repos["acme/tiny"]["branches"]["main"]
    assert hub.calls[i_tag] == ("create_tag", "v1", main)
    files = hub.repos["acme/tiny"]["commits"][main]
    assert {"model.safetensors", "config.json", "manifest.json", "README.md", "quantkit/report.json",
            "quantkit/gate.json", "quantkit/version.json"} <= set(files) and "extra.txt" not in files

    v2 = registry.publish(gated(tmp_path / "a2", 2), name="tiny", client=reg)
    assert v2.version == "2" and [v.version for v in reg.versions("tiny")] == ["1", "2"]
    assert reg.show("tiny", "v2").tags["quantkit.recipe_sha256"] == f"{2:064x}"


def test_stale_files_of_an_older_version_are_deleted(tmp_path):
    hub = FakeHub(tmp_path)
    reg = HfRegistry("hf://acme/tiny", api=hub)
    registry.publish(gated(tmp_path / "a1", 1), client=reg)
    hub.repos["acme/tiny"]["commits"][hub.repos["acme/tiny"]["branches"]["main"]]["old-shard.safetensors"] = b"x"
    registry.publish(gated(tmp_path / "a2", 2), client=reg)
    main = hub.repos["acme/tiny"]["commits"][hub.repos["acme/tiny"]["branches"]["main"]]
    assert "old-shard.safetensors" not in main and ".gitattributes" in main


def test_incomplete_upload_closes_the_pr_and_registers_nothing(tmp_path):
    hub = FakeHub(tmp_path, drop={"model.safetensors"})
    reg = HfRegistry("hf://acme/tiny", api=hub)
    with pytest.raises(RegistryError, match="model.safetensors: missing"):
        registry.publish(gated(tmp_path / "a", 1), client=reg)
    kinds = [c[0] for c in hub.calls]
    assert "merge_pull_request" not in kinds and "create_tag" not in kinds
    assert ("change_discussion_status", 1, "closed") in hub.calls
    assert reg.versions("tiny") == [] and set(hub.repos["acme/tiny"]["commits"][
        hub.repos["acme/tiny"]["branches"]["main"]]) == {".gitattributes"}


def test_promote_rollback_and_pull_with_verification(tmp_path):
    hub = FakeHub(tmp_path)
    reg = HfRegistry("hf://acme/tiny", api=hub)
    a1 = gated(tmp_path / "a1", 1)
    for i, art in enumerate((a1, gated(tmp_path / "a2", 2)), 1):
        registry.publish(art, client=reg)
    registry.promote("tiny", "1", client=reg)
    assert registry.promote("tiny", "2", client=reg).aliases == ["production"]
    assert ("delete_tag", "production") in hub.calls  # moved, not duplicated
    assert registry.rollback("tiny", client=reg).version == "1"
    with pytest.raises(RegistryError, match="nothing to roll back to"):
        registry.rollback("tiny", client=reg)
    dest = registry.pull("tiny", "production", tmp_path / "pulled", client=reg)
    assert verify(dest) == [] and (dest / "model.safetensors").read_bytes() == (a1 / "model.safetensors").read_bytes()

    repo = hub.repos["acme/tiny"]
    tampered = dict(repo["commits"][repo["tags"]["v2"]])
    tampered["model.safetensors"] = b"\0" + tampered["model.safetensors"][1:]
    repo["commits"][repo["tags"]["v2"]] = tampered
    with pytest.raises(RegistryError, match="model.safetensors: sha256 does not match"):
        registry.pull("tiny", "2", tmp_path / "bad", client=reg)
    assert not (tmp_path / "bad").exists()


def test_refusals_happen_before_any_hub_call(tmp_path):
    hub = FakeHub(tmp_path)
    reg = HfRegistry("hf://acme/tiny", api=hub)
    art = make_artifact(tmp_path / "a", seed=1)
    run_gates(make_report(art, {**GOOD_METRICS, "quality.perplexity": {"baseline": 10.0, "candidate": 11.0}}),
              gates=PPL_GATE)
    with pytest.raises(RegistryError, match="gates failed"):
        registry.publish(art, client=reg)
    with pytest.raises(RegistryError, match="unknown URI"):
        registry.open_registry("s3://bucket/x")
    assert hub.calls == []
