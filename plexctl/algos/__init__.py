"""Built-in RL algorithms, each written against the service API in ``plexctl.rl``."""
