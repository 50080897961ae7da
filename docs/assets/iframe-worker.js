// Search from a page opened from disk (file://). The theme runs its search in a Web Worker,
// which a file:// page may not start (Chromium refuses: the page's origin is opaque). There,
// this stands in for Worker: the worker's script runs in a hidden same-origin iframe (a
// srcdoc frame inherits the page's origin, and may load a file:// script), and messages are
// handed across as events. Served over http(s), the real Worker is kept.
// (The theme's offline plugin would load a shim like this from a CDN; this file's name
// tells it that one is already here, and nothing is fetched.)
(function () {
  "use strict";
  if (location.protocol !== "file:") return;
  var frames = (window.__titanWorkers = []);

  function FrameWorker(url) {
    var self = this;
    var target = document.createDocumentFragment(); // an EventTarget every browser has
    var queue = [];
    var inner = null;
    this.onmessage = null;
    this.addEventListener = target.addEventListener.bind(target);
    this.removeEventListener = target.removeEventListener.bind(target);
    this.deliver = function (data) {
      var event = new MessageEvent("message", { data: data });
      if (typeof self.onmessage === "function") self.onmessage(event);
      target.dispatchEvent(event);
    };
    this.ready = function (win) {
      inner = win;
      queue.splice(0).forEach(self.postMessage);
    };
    this.postMessage = function (data) {
      if (!inner) return queue.push(data);
      inner.dispatchEvent(new inner.MessageEvent("message", { data: data }));
    };
    var id = frames.push(this) - 1;
    var src = new URL(url, location.href).href.replace(/"/g, "&quot;");
    var host = "parent.__titanWorkers[" + id + "]";
    this.frame = document.createElement("iframe");
    this.frame.hidden = true;
    this.frame.srcdoc =
      "<script>self.postMessage = function (data) { " + host + ".deliver(data); };</" +
      'script><script src="' + src + '"></' +
      "script><script>" + host + ".ready(self);</" + "script>";
    (document.body || document.documentElement).appendChild(this.frame);
  }
  FrameWorker.prototype.terminate = function () {
    this.frame.remove();
  };
  window.Worker = FrameWorker;
})();
