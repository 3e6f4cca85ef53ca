"""`specserve bench`: an asyncio load generator for OpenAI-compatible servers, a sweep over
server configurations and concurrencies, and plots of the results."""
