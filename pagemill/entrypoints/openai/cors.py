"""CORS for browser clients, as vLLM's flags (--allowed-origins, --allowed-methods, --allowed-headers,
--allow-credentials); off unless --allowed-origins is given."""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware


def parse_list(value: str) -> list[str]:
    """A flag's list: JSON (vLLM's '["*"]') or comma-separated."""
    value = value.strip()
    if value.startswith("["):
        items = json.loads(value)
        if not isinstance(items, list) or not all(isinstance(i, str) for i in items):
            raise argparse.ArgumentTypeError(f"expected a JSON list of strings, got {value!r}")
        return items
    return [item.strip() for item in value.split(",") if item.strip()]


@dataclass(frozen=True)
class CORSOptions:
    """Which origins, methods and headers browsers may use."""

    allowed_origins: list[str]
    allowed_methods: list[str]
    allowed_headers: list[str]
    allow_credentials: bool = False

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> CORSOptions | None:
        """The options of `pagemill serve`'s flags, or None without --allowed-origins."""
        if not args.allowed_origins:
            return None
        return cls(args.allowed_origins, args.allowed_methods, args.allowed_headers, args.allow_credentials)


def add_cors_args(group: argparse._ArgumentGroup) -> None:
    """The CORS flags."""
    group.add_argument("--allowed-origins", type=parse_list, default=None,
                       help="Origins browsers may call from, JSON list or comma-separated (e.g. '[\"*\"]'); "
                            "CORS is off without it.")
    group.add_argument("--allowed-methods", type=parse_list, default=["*"], help="CORS: allowed methods.")
    group.add_argument("--allowed-headers", type=parse_list, default=["*"], help="CORS: allowed headers.")
    group.add_argument("--allow-credentials", action="store_true", help="CORS: allow credentials.")


def add_cors(app: FastAPI, options: CORSOptions) -> None:
    """Answer CORS preflights and add the CORS headers (outermost, so preflights need no API key)."""
    app.add_middleware(CORSMiddleware, allow_origins=options.allowed_origins,
                       allow_methods=options.allowed_methods, allow_headers=options.allowed_headers,
                       allow_credentials=options.allow_credentials)
