"""The one package every service shares: subjects, events, models, config, bus, logging.

Services import from here and never from each other.
"""
