"""Write docs/commands/<command>.md from colifs' own --help, plus examples: a page per subcommand.

    python contrib/gen_command_docs.py [OUT_DIR]      (default docs/commands)

The tests regenerate the pages and compare, so a page can never disagree with `--help`.
"""

from __future__ import annotations

import contextlib
import io
import os
import sys
from pathlib import Path

EXAMPLES = {
    "mount": """colifs mount /fast/m /second/m /mnt/model --weights 9,3     # two drives, 9 and 3 GB/s
colifs mount /fast/m /second/m /mnt/model                  # weights measured by a 2 s probe
colifs mount /fast/m /mnt/model --usage-file /var/lib/colifs/m.json   # primary only, learn usage
cat /mnt/model/.colifs/stats""",
    "umount": """colifs umount /mnt/model      # returns once the daemon has saved its usage and exited""",
    "stats": """colifs stats /mnt/model
colifs stats /mnt/model --json | jq '.replicas[] | {name, byte_share, health}'
colifs stats /mnt/model --prometheus > /var/lib/node_exporter/textfile/colifs.prom""",
    "top": """colifs top /mnt/model              # q quits
colifs top /mnt/model --count 5 --interval 2 > top.log""",
    "route": """colifs route /mnt/model/model-00003-of-00163.safetensors 123456789
getfattr -n user.colifs.replicas /mnt/model/model-00003-of-00163.safetensors""",
    "plan": """colifs plan /fast/m /second/m --budget 200G --reserve 20G
colifs plan /fast/m /second/m --budget 200G --usage /fast/m/.coli_usage --weights 9,3 --json""",
    "stage": """colifs stage /fast/m /second/m --budget 200G --reserve 20G
colifs stage /fast/m /second/m --budget 200G -q     # no progress (cron, CI)""",
    "verify": """colifs verify /fast/m /second/m            # sizes and headers, like the mount
colifs verify /fast/m /second/m --deep     # and every byte (SHA-256 of both, read in parallel)""",
    "probe": """colifs probe /fast/m /second/m --seconds 5""",
    "bench": """colifs bench /mnt/model --threads 16 --seconds 10            # through the mount
colifs bench /fast/m /second/m --weights 9,3                  # the drives' own limit
colifs bench /mnt/model --zipf 1.0 --mmap""",
    "completion": """colifs completion bash > /etc/bash_completion.d/colifs""",
    "mirror": """colifs mirror remove /mnt/model /second/m && umount /second     # the drive is free at once
colifs mirror add /mnt/model /second/m --weight 3                 # back (its drive mounted again)
colifs mirror add /mnt/model /new-ssd/m                           # or a replacement, weight measured
colifs mirror add /mnt/model /new-ssd/m --deep --timeout 3600     # every byte compared first""",
}


def help_text(*command: str) -> str:
    from colifs.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
        main([*command, "--help"])
    return out.getvalue()


def pages() -> dict[str, str]:
    os.environ["COLUMNS"] = "100"  # argparse wraps to the terminal: fixed for stable pages
    from colifs.cli import parser
    from colifs.completion import _subparsers

    out = {}
    for name, sub in _subparsers(parser()).items():
        text = f"# colifs {name}\n\n{sub.description}\n\n```\n{help_text(name).rstrip()}\n```\n"
        for action in _subparsers(sub):  # `colifs mirror add|remove`
            text += f"\n## colifs {name} {action}\n\n```\n{help_text(name, action).rstrip()}\n```\n"
        if name in EXAMPLES:
            text += f"\n## Examples\n\n```\n{EXAMPLES[name]}\n```\n"
        text += "\nEvery error is one line on stderr with a specific exit code (see the README).\n"
        out[f"{name}.md"] = text
    return out


def main() -> None:
    target = Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).parents[1] / "docs" / "commands")
    target.mkdir(parents=True, exist_ok=True)
    for name, text in pages().items():
        (target / name).write_text(text)


if __name__ == "__main__":
    main()
