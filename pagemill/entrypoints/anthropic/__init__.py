"""Anthropic's Messages API (`POST /v1/messages`, `/v1/messages/count_tokens`) served through the chat path."""
