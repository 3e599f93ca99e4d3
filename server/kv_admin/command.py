"""``flashtier kv stats | verify | wipe``: the operator's tools for an SSD tier directory.

    flashtier kv stats  [--kv-dir DIR] [--kv-disk-budget SIZE] [--kv-lifetime DUR] [--json]
    flashtier kv verify [--kv-dir DIR] [--json]
    flashtier kv wipe   [--kv-dir DIR] (--all | --older-than DUR | --namespace NS | --api-key KEY)
                        (--yes | --dry-run) [--json]

DIR, SIZE and DUR are read as ``serve`` reads them: the flag, else ``FLASHTIER_KV_DIR``,
``FLASHTIER_KV_DISK_BUDGET``, ``FLASHTIER_KV_LIFETIME``, else (budget, lifetime) serve's defaults; so in
the container, where those variables are set for the server, the tools see the server's settings.

Each command refuses a directory a live server or store holds (kv_admin/lock.py) with one line and exit
status 2, as every bad argument. ``stats`` and ``verify`` only read; ``verify`` exits 1 when a record or a
range fails its checks (they are listed), 0 otherwise. ``wipe`` removes records (kvstore/ssd/admin/wipe.py:
whole segments, or segments rewritten without the selected records) and needs ``--yes``; ``--dry-run``
counts what it would remove. ``--namespace NS`` (a shared-mode cache_salt, or the tenant hex of a key) and
``--api-key KEY`` (the key's tenant under per-key isolation, derived as the server derives it,
kvstore/tenant.py) remove one tenant: its SSD records, live or superseded, with the bytes no tenant can
be proven to own, and (``--api-key``) its stored conversations under ``KV_DIR/responses`` (overwritten,
fsynced, unlinked). ``--all`` removes the stored conversations too (docs/operations.md, "Deleting a tenant").
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import functools
import os
import time
from collections.abc import Callable, Mapping
from typing import Any

from flashtier.kvstore.ssd.admin.report import tier_report
from flashtier.kvstore.ssd.admin.scan import scan_tier
from flashtier.kvstore.ssd.admin.verify import verify_tier
from flashtier.kvstore.ssd.admin.wipe import wipe_tier
from flashtier.server.kv_admin.format import format_report, format_verify, format_wipe
from flashtier.kvstore.tenant import api_key_tenant, tenant_tag
from flashtier.kvstore.snapshot.persist import FILE_NAME as SAVED_POOL, discard_saved
from flashtier.server.kv_admin.lock import admin_access
from flashtier.server.response_store.owner import count_files, delete_owner_files, response_owner, responses_dir
from flashtier.server.config.options import ENV_PREFIX, OPTIONS, Option
from flashtier.server.config.settings import default_cache_dir, default_kv_dir

__all__ = ["add_kv_parser"]

EXIT_BAD_RECORDS = 1


def _option(dest: str) -> Option:
    return next(opt for opt in OPTIONS if opt.dest == dest)


def _setting(args: argparse.Namespace, dest: str, environ: Mapping[str, str]) -> Any:
    """A serve setting for the tools: the flag, else its FLASHTIER_* variable, else serve's default.
    ValueError naming the variable when its text does not parse."""
    opt = _option(dest)
    value = getattr(args, dest, None)
    if value is not None:
        return value
    text = environ.get(opt.env)
    if not text:
        return opt.default
    try:
        return opt.parse(text)
    except ValueError as exc:
        raise ValueError(f"{opt.env}={text!r}: {exc}") from None


def _kv_dir(args: argparse.Namespace, environ: Mapping[str, str]) -> str:
    """--kv-dir, else its variable, else the directory ``serve`` uses by default (CACHE_DIR/kv/MODEL, with
    --cache-dir / FLASHTIER_CACHE_DIR, FLASHTIER_MODEL_DIR and FLASHTIER_PRESET as serve reads them).
    ValueError naming the flag when that default does not exist."""
    kv_dir = _setting(args, "kv_dir", environ)
    if not kv_dir:
        cache_dir = _setting(args, "cache_dir", environ) or default_cache_dir(environ)
        kv_dir = default_kv_dir(cache_dir, environ.get(ENV_PREFIX + "MODEL_DIR") or None,
                                environ.get(ENV_PREFIX + "PRESET") or None)
        if not os.path.isdir(kv_dir):
            raise ValueError(f"--kv-dir: no SSD tier at {kv_dir}, the directory `flashtier serve` uses by default; "
                             f"pass --kv-dir DIR (or set {_option('kv_dir').env}) for another one")
    return os.path.abspath(os.path.expanduser(kv_dir))


def _os_errors(fn: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """An OSError of the file system (a segment that cannot be read, a full disk) as one ValueError line."""

    @functools.wraps(fn)
    def run(args: argparse.Namespace) -> int:
        try:
            return fn(args)
        except OSError as exc:
            raise ValueError(f"{exc.filename or args.kv_dir}: {exc.strerror or exc}") from None

    return run


def _emit(args: argparse.Namespace, obj: Any, text: str) -> None:
    print(json.dumps(dataclasses.asdict(obj), indent=2) if args.json else text)


@_os_errors
def _stats(args: argparse.Namespace) -> int:
    kv_dir = _kv_dir(args, os.environ)
    budget = _setting(args, "kv_disk_budget", os.environ)
    lifetime = _setting(args, "kv_lifetime_s", os.environ)
    with admin_access(kv_dir, write=False):
        report = tier_report(scan_tier(kv_dir), now=time.time(), budget_bytes=budget, lifetime_s=lifetime)
        stored = count_files(responses_dir(kv_dir))
    text = format_report(report) + (f"\n  responses       {stored.records:,} stored conversations ({stored.bytes:,} B) "
                                    f"in {responses_dir(kv_dir)}")
    if args.json:
        print(json.dumps({**dataclasses.asdict(report), "responses": dataclasses.asdict(stored)}, indent=2))
    else:
        print(text)
    return 0


@_os_errors
def _verify(args: argparse.Namespace) -> int:
    kv_dir = _kv_dir(args, os.environ)
    with admin_access(kv_dir, write=False):
        report = verify_tier(scan_tier(kv_dir))
    _emit(args, report, format_verify(report))
    return 0 if report.ok else EXIT_BAD_RECORDS


@_os_errors
def _wipe(args: argparse.Namespace) -> int:
    kv_dir = _kv_dir(args, os.environ)
    if not (args.yes or args.dry_run):
        raise ValueError("kv wipe deletes records: add --yes, or --dry-run to count what it would delete")
    owner: str | None = None
    tenant_wipe = args.namespace is not None or args.api_key is not None
    if args.all:
        what, select = "every record", lambda header: True
    elif tenant_wipe:
        if args.api_key is not None:
            if not args.api_key:
                raise ValueError("--api-key: an API key is a non-empty string")
            name, owner = api_key_tenant(args.api_key), response_owner(args.api_key)
            what = f"tenant of the API key, namespace {name}"
        else:
            name, what = args.namespace, f"namespace {args.namespace!r}"
        tag = tenant_tag(name)
        what += f", tag {tag.hex()}"
        select = lambda header: header.tenant == tag  # noqa: E731
    else:
        cutoff = time.time() - args.older_than
        what, select = f"records older than {args.older_than:g} s", lambda header: header.created_at < cutoff
    with admin_access(kv_dir, write=not args.dry_run):
        result = wipe_tier(kv_dir, select, dry_run=args.dry_run, drop_unattributed=tenant_wipe)
        # the embedded pool saved at the last clean stop holds window snapshots of every tenant: erased whole
        snapshots = discard_saved(kv_dir, dry_run=args.dry_run) if args.all or tenant_wipe else 0
        if args.all or owner is not None:
            responses = delete_owner_files(responses_dir(kv_dir), owner, everything=args.all, dry_run=args.dry_run)
        else:
            responses = None
    text = format_wipe(result, kv_dir, what, dry_run=args.dry_run)
    verb = "would remove" if args.dry_run else "removed"
    if responses is not None:
        text += f"\nresponse store {responses_dir(kv_dir)}: {verb} {responses.records:,} stored conversations"
    elif tenant_wipe:
        text += ("\nresponse store: not touched (stored conversations carry an owner only for --api-key under "
                 "--cache-isolation per-key)")
    else:
        text += f"\nresponse store {responses_dir(kv_dir)}: not touched (only --all and --api-key remove " \
                "stored conversations)"
    if snapshots:
        text += (f"\nsaved snapshot pool {os.path.join(kv_dir, SAVED_POOL)}: {verb} ({snapshots:,} B; every tenant's "
                 "window snapshots, so other conversations resume by bounded replay once)")
    if args.json:
        print(json.dumps({**dataclasses.asdict(result), "saved_snapshot_bytes": snapshots,
                          "responses": dataclasses.asdict(responses) if responses else None}, indent=2))
    else:
        print(text)
    return 0


def _typed(dest: str):
    """argparse type of the serve option ``dest`` (its parser, errors as argparse errors)."""
    opt = _option(dest)

    def parse(text: str) -> Any:
        try:
            return opt.parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    parse.__name__ = dest
    return parse


def add_kv_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``kv`` and its three commands on the ``flashtier`` subparsers ``sub``."""
    kv = sub.add_parser("kv", help="inspect, verify or wipe an SSD tier directory (no server may be running "
                                   "on it)")
    cmds = kv.add_subparsers(dest="kv_command", required=True)

    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument("--kv-dir", dest="kv_dir", default=None,
                       help=f"the SSD tier directory [env {_option('kv_dir').env}] (default: the one `serve` uses, "
                            "CACHE_DIR/kv/MODEL)")
        p.add_argument("--cache-dir", dest="cache_dir", default=None,
                       help=f"serve's cache directory, for the default --kv-dir [env {_option('cache_dir').env}]")
        p.add_argument("--json", action="store_true", help="print one JSON object")

    stats = cmds.add_parser("stats", help="entries, bytes, age histogram, budget")
    common(stats)
    stats.add_argument("--kv-disk-budget", dest="kv_disk_budget", type=_typed("kv_disk_budget"), default=None,
                       help=f"the server's budget (default 512G) [env {_option('kv_disk_budget').env}]")
    stats.add_argument("--kv-lifetime", dest="kv_lifetime_s", type=_typed("kv_lifetime_s"), default=None,
                       help=f"the server's lifetime (default 72h) [env {_option('kv_lifetime_s').env}]")
    stats.set_defaults(func=_stats)

    verify = cmds.add_parser("verify", help="check every record's crc32c and report bad ones (read-only; exit 1 "
                                            "when any is bad)")
    common(verify)
    verify.set_defaults(func=_verify)

    wipe = cmds.add_parser("wipe", help="remove records: all of them, or those older than a duration")
    common(wipe)
    which = wipe.add_mutually_exclusive_group(required=True)
    which.add_argument("--all", action="store_true", help="every record (e.g. after a model change)")
    which.add_argument("--older-than", dest="older_than", type=_typed("kv_lifetime_s"), default=None,
                       metavar="DUR", help="records written more than DUR ago (e.g. 24h)")
    which.add_argument("--namespace", dest="namespace", default=None, metavar="NS",
                       help="one tenant: its cache_salt (shared isolation) or the tenant hex of a key")
    which.add_argument("--api-key", dest="api_key", default=None, metavar="KEY",
                       help="one tenant: the API key's (per-key isolation), stored conversations included")
    wipe.add_argument("--yes", action="store_true", help="really delete")
    wipe.add_argument("--dry-run", dest="dry_run", action="store_true", help="count, delete nothing")
    wipe.set_defaults(func=_wipe)

