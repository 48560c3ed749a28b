"""The tokenizer for clients: vLLM's `GET /tokenizer_info`, and the Hugging Face Hub's file protocol for the served
model names, so that `HF_ENDPOINT=http://host:port AutoTokenizer.from_pretrained("<served name>")` (guidellm,
lm-eval, ...) loads the server's own tokenizer.

Hub routes (read-only; nothing but the exported tokenizer files):
  GET|HEAD /{repo_id}/resolve/{revision}/{filename}      the file, with ETag, X-Repo-Commit, Content-Length
  GET /api/models/{repo_id}[/revision/{revision}]         model info (sha, siblings)
  GET /api/models/{repo_id}/tree/{revision}[/{path}]      the file listing
`revision` is `main` or the commit hash the server reports. Errors are OpenAI error bodies with the Hub's
`X-Error-Code` header (RepoNotFound, RevisionNotFound, EntryNotFound), which huggingface_hub reads.
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict

from pagemill.entrypoints.openai.errors import error_body
from pagemill.entrypoints.openai.tokenizer_files import TokenizerFiles, tokenizer_info

DEFAULT_REVISION = "main"


class TokenizerInfoResponse(BaseModel):
    """GET /tokenizer_info: the tokenizer's configuration, as tokenizer_config.json holds it (vLLM's)."""

    model_config = ConfigDict(extra="allow")
    tokenizer_class: str


def _not_found(message: str, error_code: str, commit: str | None = None) -> JSONResponse:
    headers = {"X-Error-Code": error_code, "X-Error-Message": message}
    if commit is not None:
        headers["X-Repo-Commit"] = commit
    return JSONResponse(error_body(message, 404), status_code=404, headers=headers)


class HubRepo:
    """The served model names as Hub repositories holding the exported tokenizer files."""

    def __init__(self, files: TokenizerFiles, served_model_names: list[str]) -> None:
        self.files = files
        # longest first: "org/model" wins over "org" when both are served
        self.names = sorted(served_model_names, key=len, reverse=True)

    async def snapshot(self) -> tuple[dict[str, Any], str]:
        """(files, commit hash), exporting the tokenizer on first use (off the event loop)."""
        files = await asyncio.to_thread(self.files.files)
        return files, await asyncio.to_thread(self.files.commit_hash)

    def split(self, rest: str) -> tuple[str, str] | None:
        """('org/model', '/tree/main') from 'org/model/tree/main': the served name `rest` starts with."""
        for name in self.names:
            if rest == name or rest.startswith(name + "/"):
                return name, rest[len(name):]
        return None

    def unknown_repo(self, repo_id: str) -> JSONResponse:
        """The 404 of a repository that is not a served model name."""
        return _not_found(f"Repository {repo_id!r} not found: this server serves the tokenizer of "
                          f"{', '.join(sorted(self.names))}.", "RepoNotFound")

    async def resolve(self, repo_id: str, revision: str, filename: str, head: bool) -> Response:
        """A file's bytes (or only its headers for HEAD)."""
        if repo_id not in self.names:
            return self.unknown_repo(repo_id)
        files, commit = await self.snapshot()
        if revision not in (DEFAULT_REVISION, commit):
            return _not_found(f"Revision {revision!r} not found in {repo_id!r} (have: main, {commit}).",
                              "RevisionNotFound")
        f = files.get(filename)
        if f is None:
            return _not_found(f"File {filename!r} not found in {repo_id!r} (have: {', '.join(files)}).",
                              "EntryNotFound", commit)
        headers = {"ETag": f'"{f.etag}"', "X-Repo-Commit": commit, "Accept-Ranges": "none"}
        media = "application/json" if filename.endswith(".json") else "text/plain; charset=utf-8"
        if head:
            headers["Content-Length"] = str(len(f.content))
            return Response(status_code=200, headers=headers, media_type=media)
        return Response(f.content, headers=headers, media_type=media)

    async def api(self, rest: str) -> Response:
        """/api/models/{repo_id}, .../revision/{revision}, .../tree/{revision}[/{path}]."""
        parts = self.split(rest)
        if parts is None:
            return self.unknown_repo(rest)
        repo_id, tail = parts
        kind, _, after = tail.lstrip("/").partition("/")
        revision, _, path = after.partition("/")
        if kind not in ("", "revision", "tree") or (kind == "revision" and path):
            return _not_found(f"No such Hub API route: /api/models/{rest}.", "EntryNotFound")
        files, commit = await self.snapshot()
        if kind and revision not in (DEFAULT_REVISION, commit):
            return _not_found(f"Revision {revision!r} not found in {repo_id!r} (have: main, {commit}).",
                              "RevisionNotFound")
        if kind == "tree":
            if path.strip("/"):  # the files all sit at the root: a folder below it does not exist
                return _not_found(f"Folder {path!r} not found in {repo_id!r}.", "EntryNotFound", commit)
            return JSONResponse([{"type": "file", "path": n, "size": len(f.content), "oid": f.etag}
                                 for n, f in files.items()], headers={"X-Repo-Commit": commit})
        return JSONResponse({"id": repo_id, "modelId": repo_id, "sha": commit, "private": False, "gated": False,
                             "disabled": False, "tags": [], "library_name": "transformers",
                             "siblings": [{"rfilename": n} for n in files]})


def add_tokenizer_routes(app: FastAPI, tokenizer: Any, served_model_names: list[str], chat_template: str | None,
                         enable_tokenizer_info: bool, serve_tokenizer_files: bool) -> None:
    """Register GET /tokenizer_info (vLLM's --enable-tokenizer-info-endpoint) and the Hub file routes
    (--serve-tokenizer-files); both read-only. The Hub routes are left out of the OpenAPI document (they speak the
    Hub's protocol, not OpenAI's)."""
    if enable_tokenizer_info:
        @app.get("/tokenizer_info", response_model=TokenizerInfoResponse)
        async def get_tokenizer_info() -> JSONResponse:
            """The tokenizer's configuration (init kwargs, class, the server's chat template), as vLLM serves it."""
            return JSONResponse(tokenizer_info(tokenizer, chat_template))

    if not serve_tokenizer_files:
        return
    repo = HubRepo(TokenizerFiles(tokenizer, chat_template), served_model_names)

    @app.api_route("/api/models/{rest:path}", methods=["GET"], include_in_schema=False)
    async def hub_api(rest: str) -> Response:
        return await repo.api(rest)

    @app.api_route("/{repo_id:path}/resolve/{revision}/{filename:path}", methods=["GET", "HEAD"],
                   include_in_schema=False)
    async def hub_resolve(repo_id: str, revision: str, filename: str, request: Request) -> Response:
        return await repo.resolve(repo_id, revision, filename, head=request.method == "HEAD")
