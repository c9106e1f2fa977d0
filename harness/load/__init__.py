"""Load on the kill switch: a Locust file (run by Locust, in processes of its own) and the
runner that brings a fleet of working agents up for it and judges what it measured."""
