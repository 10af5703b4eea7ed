// Interop peer: TS SDK v1 (@modelcontextprotocol/sdk 1.32.2) over stdio, one `echo` tool.
import * as z from 'zod';
import { McpServer } from '@modelcontextprotocol/sdk/server/mcp.js';
import { StdioServerTransport } from '@modelcontextprotocol/sdk/server/stdio.js';

const server = new McpServer({ name: 'iteron-interop-ts-v1', version: '1.32.2' });
server.registerTool(
  'echo',
  { description: 'Return the given text unchanged', inputSchema: { text: z.string() } },
  async ({ text }) => ({ content: [{ type: 'text', text }] }),
);
await server.connect(new StdioServerTransport());
