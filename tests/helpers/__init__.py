"""What the tests share: tiny models, engines, launchers, probes and stand-ins."""
