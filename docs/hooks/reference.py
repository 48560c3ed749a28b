"""MkDocs hook: adds the generated reference pages (engine arguments, CLI) to the site at every build, from the code
that builds `--help` (pagemill/entrypoints/cli_docs.py), so the pages cannot drift from it."""

from __future__ import annotations

from mkdocs.structure.files import File

PAGES = {
    "reference/engine_args.md": "engine_args_markdown",
    "reference/cli.md": "cli_markdown",
    "reference/api.md": "api_markdown",
}


def on_files(files, config):
    from pagemill.entrypoints import cli_docs

    for uri, func in PAGES.items():
        files.append(File.generated(config, uri, content=getattr(cli_docs, func)()))
    return files
