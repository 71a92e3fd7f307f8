"""Figures: matplotlib drawings shared by the report service, the CLI and the Telegram bot
(curves, parallel coordinates, heat maps; a run on a phone). Below the services: it knows
only `m27.common`."""
