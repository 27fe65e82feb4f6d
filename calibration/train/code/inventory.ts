/**
 * inventory.ts
 *
 * Stock tracking for a small shop: receive deliveries, record sales, reserve
 * items for online orders, and report what needs reordering.
 *
 * Quantities are integers (units). Every change goes through `applyMovement`
 * so there is a single place that enforces the rules and writes the audit log.
 */

export type Sku = string;

export type MovementKind = "receive" | "sell" | "reserve" | "release" | "adjust";

export interface Movement {
  sku: Sku;
  kind: MovementKind;
  quantity: number;
  at: Date;
  reference?: string; // order number, delivery note, or reason for an adjustment
}

export interface StockLevel {
  onHand: number;   // physically in the shop
  reserved: number; // promised to orders that have not shipped yet
}

export interface ItemSettings {
  name: string;
  reorderPoint: number;    // reorder when available stock falls to this level
  reorderQuantity: number; // how many to order each time
  supplier: string;
}

export class StockError extends Error {
  constructor(message: string, readonly sku: Sku) {
    super(`${sku}: ${message}`);
    this.name = "StockError";
  }
}

export class Inventory {
  private readonly levels = new Map<Sku, StockLevel>();
  private readonly settings = new Map<Sku, ItemSettings>();
  private readonly log: Movement[] = [];

  defineItem(sku: Sku, settings: ItemSettings): void {
    if (settings.reorderQuantity <= 0) {
      throw new StockError("reorder quantity must be positive", sku);
    }
    this.settings.set(sku, settings);
    if (!this.levels.has(sku)) {
      this.levels.set(sku, { onHand: 0, reserved: 0 });
    }
  }

  /** Units that can still be sold or reserved. */
  available(sku: Sku): number {
    const level = this.level(sku);
    return level.onHand - level.reserved;
  }

  level(sku: Sku): StockLevel {
    const level = this.levels.get(sku);
    if (!level) throw new StockError("unknown item", sku);
    return level;
  }

  receive(sku: Sku, quantity: number, deliveryNote?: string): void {
    this.applyMovement({ sku, kind: "receive", quantity, at: new Date(), reference: deliveryNote });
  }

  sell(sku: Sku, quantity: number, receipt?: string): void {
    this.applyMovement({ sku, kind: "sell", quantity, at: new Date(), reference: receipt });
  }

  reserve(sku: Sku, quantity: number, orderId: string): void {
    this.applyMovement({ sku, kind: "reserve", quantity, at: new Date(), reference: orderId });
  }

  release(sku: Sku, quantity: number, orderId: string): void {
    this.applyMovement({ sku, kind: "release", quantity, at: new Date(), reference: orderId });
  }

  /** Correct the count after a stocktake. `delta` may be negative. */
  adjust(sku: Sku, delta: number, reason: string): void {
    if (!reason.trim()) throw new StockError("adjustments need a reason", sku);
    this.applyMovement({ sku, kind: "adjust", quantity: delta, at: new Date(), reference: reason });
  }

  private applyMovement(m: Movement): void {
    if (!Number.isInteger(m.quantity)) {
      throw new StockError(`quantity must be a whole number, got ${m.quantity}`, m.sku);
    }
    if (m.kind !== "adjust" && m.quantity <= 0) {
      throw new StockError(`${m.kind} quantity must be positive`, m.sku);
    }
    const level = this.level(m.sku);
    const next: StockLevel = { ...level };

    switch (m.kind) {
      case "receive":
        next.onHand += m.quantity;
        break;
      case "sell":
        if (m.quantity > level.onHand - level.reserved) {
          throw new StockError(`only ${level.onHand - level.reserved} available to sell`, m.sku);
        }
        next.onHand -= m.quantity;
        break;
      case "reserve":
        if (m.quantity > level.onHand - level.reserved) {
          throw new StockError("not enough stock to reserve", m.sku);
        }
        next.reserved += m.quantity;
        break;
      case "release":
        if (m.quantity > level.reserved) {
          throw new StockError("cannot release more than is reserved", m.sku);
        }
        next.reserved -= m.quantity;
        break;
      case "adjust":
        next.onHand += m.quantity;
        if (next.onHand < next.reserved) {
          throw new StockError("adjustment would leave reservations uncovered", m.sku);
        }
        break;
    }

    this.levels.set(m.sku, next);
    this.log.push(m);
  }

  /** Items at or below their reorder point, grouped by supplier. */
  reorderReport(): Map<string, Array<{ sku: Sku; name: string; available: number; order: number }>> {
    const bySupplier = new Map<string, Array<{ sku: Sku; name: string; available: number; order: number }>>();
    for (const [sku, s] of this.settings) {
      const available = this.available(sku);
      if (available > s.reorderPoint) continue;
      // Order enough to get back above the reorder point even after a big sale.
      let order = s.reorderQuantity;
      while (available + order <= s.reorderPoint) order += s.reorderQuantity;
      const rows = bySupplier.get(s.supplier) ?? [];
      rows.push({ sku, name: s.name, available, order });
      bySupplier.set(s.supplier, rows);
    }
    for (const rows of bySupplier.values()) rows.sort((a, b) => a.available - b.available);
    return bySupplier;
  }

  history(sku?: Sku): readonly Movement[] {
    return sku ? this.log.filter((m) => m.sku === sku) : this.log;
  }
}

// Example usage, handy when trying the module in a REPL.
if (typeof require !== "undefined" && require.main === module) {
  const inv = new Inventory();
  inv.defineItem("TEA-EB-250", { name: "English breakfast tea 250g", reorderPoint: 10, reorderQuantity: 24, supplier: "Leafline" });
  inv.defineItem("MUG-STN-BL", { name: "Stoneware mug, blue", reorderPoint: 4, reorderQuantity: 12, supplier: "Clayworks" });
  inv.receive("TEA-EB-250", 30, "DN-5521");
  inv.receive("MUG-STN-BL", 6, "DN-5522");
  inv.sell("TEA-EB-250", 18, "R-10443");
  inv.reserve("MUG-STN-BL", 3, "WEB-2291");
  for (const [supplier, rows] of inv.reorderReport()) {
    console.log(supplier);
    for (const r of rows) console.log(`  ${r.sku.padEnd(12)} ${String(r.available).padStart(3)} left, order ${r.order}`);
  }
}
