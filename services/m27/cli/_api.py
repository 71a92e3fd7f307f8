"""`m27 api keys` and `m27 api token create`: the credentials of the gRPC API.

`m27 up` makes the embedded system's keys and an admin token for whoever started it. A lab
sharing one system gives every member a token of their own (`token create --user alice`),
which names them: the API takes the user from it, never from a request.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from m27.cli._common import Subparsers, add, config
from m27.common import api_auth, tokens
from m27.common.errors import M27Error
from m27.common.secret_files import write_secret
from m27.common.units import parse_duration


def add_commands(sub: Subparsers) -> None:
    api = add(sub, "api", "the gRPC API's credentials: keys of a deployment, tokens for its "
              "users (`m27 up` makes its own and yours)", _usage)
    verbs = api.add_subparsers(dest="verb", metavar="VERB", required=True)
    keys = verbs.add_parser(
        "keys", help="write control.key and node.key (mode 0600) into DIR",
        description="Write the control-plane key (control.key: the orchestrator, scheduler, "
        "checkpoint-store and report services, and whoever creates tokens) and the node key "
        "(node.key: node-agents only) into DIR, keeping a key already there unless --rotate. "
        "Point [api] key_file / node_key_file at them, or put them in Secrets.")
    keys.add_argument("dir", metavar="DIR", type=Path)
    keys.add_argument("--rotate", action="store_true",
                      help="new keys: every token made before stops working (make new ones "
                      "and restart the services)")
    keys.set_defaults(handler=cmd_keys)
    token = verbs.add_parser("token", help="API tokens").add_subparsers(
        dest="action", metavar="ACTION", required=True)
    create = token.add_parser(
        "create", help="make a token for a user and write it to a file only they should read",
        description="Sign a token with the control-plane key ([api] key_file, default "
        "$M27_HOME/credentials/api/control.key) and write it to --out (mode 0600). Its "
        "holder is USER to every m27 API: give it to them, and they set [client] "
        "token_file (or $M27_TOKEN). Roles: user (their own runs), admin (anyone's runs, "
        "cordon, drain, delete checkpoints), service (reads every run).")
    create.add_argument("--user", required=True, help="the m27 user the token names")
    create.add_argument("--role", choices=("user", "admin", "service"), default="user",
                        help="default: %(default)s")
    create.add_argument("--expires", metavar="DURATION", default="0",
                        help="valid for this long, e.g. 90d (default: until the keys rotate)")
    create.add_argument("--out", metavar="FILE", type=Path,
                        help="where to write it (default: $M27_HOME/credentials/api/"
                        "users/USER.token); `-` prints it")
    create.set_defaults(handler=cmd_token_create)


def _usage(args: argparse.Namespace) -> int:  # argparse requires a verb first
    raise M27Error("`m27 api keys DIR` or `m27 api token create --user USER`")


def cmd_keys(args: argparse.Namespace) -> int:
    api_auth.ensure_keys(args.dir, rotate=args.rotate)
    print(f"{args.dir / api_auth.CONTROL_KEY} (control plane) and {args.dir / api_auth.NODE_KEY}"
          f" (node-agents): {'new' if args.rotate else 'kept or new'}")
    return 0


def cmd_token_create(args: argparse.Namespace) -> int:
    try:
        ttl = parse_duration(args.expires)
    except ValueError as exc:
        raise M27Error(f"--expires: {exc}") from exc
    if not tokens.USER_NAME.fullmatch(args.user):
        raise M27Error(f"--user: not a user name: {args.user[:100]!r} (letters, digits, "
                       "_ . @ -)")
    keys = api_auth.load_keys(config(args).api, args.home, "orchestrator")
    text = keys.mint(user=args.user, role=args.role, ttl_s=ttl)
    if str(args.out) == "-":
        print(text)
        return 0
    out = args.out or api_auth.api_dir(args.home) / "users" / f"{args.user}.token"
    write_secret(out, text.encode() + b"\n")
    print(f"token for {args.user} ({args.role}"
          f"{', expires in ' + args.expires if ttl else ''}) written to {out}")
    return 0
