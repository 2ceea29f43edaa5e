"""What the front ends (Engine, HTTP server) and the rank share: the rank's config, its outputs and load
figures, and the checks a request passes before it is queued. Below the scheduler, so a request's path only
goes down."""
