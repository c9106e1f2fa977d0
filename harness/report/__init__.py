"""Reports for people on call: a self-contained page per game day (`page`), an index of runs
across time with a regression gate (`runs`), and what pytest prints and records (`summary`)."""
