"""`python -m m27.telegram --nats URL [--api HOST:PORT]`: the Telegram bot.

Like every service: `flags.py` (the command line), `service.py` (the shell that `serve`s)
and this entry point.
"""

from m27.common.service import main
from m27.telegram import flags
from m27.telegram.service import serve

if __name__ == "__main__":
    main(flags, serve)
