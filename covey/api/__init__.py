"""HTTP and WebSocket routes, one small router per resource."""
