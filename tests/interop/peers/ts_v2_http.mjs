// Interop peer: TS SDK v2 (@modelcontextprotocol/server 2.4.0 + @modelcontextprotocol/node 2.1.2),
// the 2026-07-28 line, served by createMcpHandler over node:http on loopback.
//
// Environment switch: RESPONSE_MODE=auto|sse|json (default auto) for modern exchanges.
// Legacy (2025) traffic is served statelessly, the SDK default.
// Listens on 127.0.0.1 with an OS-chosen port and prints "LISTENING <port>" once ready.
import { createServer } from 'node:http';
import * as z from 'zod';
import { McpServer, createMcpHandler } from '@modelcontextprotocol/server';
import { toNodeHandler } from '@modelcontextprotocol/node';

function factory() {
  const server = new McpServer({ name: 'iteron-interop-ts-v2', version: '2.4.0' });
  server.registerTool(
    'echo',
    { description: 'Return the given text unchanged', inputSchema: z.object({ text: z.string() }) },
    async ({ text }) => ({ content: [{ type: 'text', text }] }),
  );
  return server;
}

const handler = createMcpHandler(factory, { responseMode: process.env.RESPONSE_MODE || 'auto' });
const serve = toNodeHandler(handler);

const http = createServer((req, res) => {
  const path = new URL(req.url ?? '/', 'http://127.0.0.1').pathname;
  if (path !== '/mcp') {
    res.writeHead(404, { 'content-type': 'text/plain' }).end('not found\n');
    return;
  }
  void serve(req, res);
});
http.listen(0, '127.0.0.1', () => {
  process.stdout.write(`LISTENING ${http.address().port}\n`);
});
for (const sig of ['SIGTERM', 'SIGINT']) process.on(sig, () => process.exit(0));
